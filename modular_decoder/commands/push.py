"""`modular-decoder push FOLDER REPO_ID`: upload a converted or trained checkpoint folder to the Hub.

Checks that the folder is a complete remote-code repository first (renders the model card if it is
the only thing missing), then `HfApi.create_repo` + `HfApi.upload_folder` (+ the card). Nothing is
written into the folder unless the push succeeded; then the card it pushed is saved there too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from huggingface_hub import HfApi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", type=Path, help="a checkpoint folder written by save_pretrained / convert")
    parser.add_argument("repo_id", help="target repository, e.g. user/my-model")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", default=None, help="Hub token (default: the logged-in one)")
    parser.add_argument("--revision", default=None, help="branch to push to")
    parser.add_argument("--commit-message", default="Upload modular_decoder checkpoint")
    parser.add_argument("--base-model", default=None, help="Hub id of the source weights, for a card written here")


def run(args: argparse.Namespace) -> int:
    from modular_decoder.commands import UserError, user_input
    from modular_decoder.tools.cards import render_model_card
    from modular_decoder.configuration_modular_decoder import ModularDecoderConfig
    from modular_decoder.tools.hub import check_hub_folder

    folder: Path = args.folder
    with user_input():
        missing = check_hub_folder(folder)
        writes_card = "README.md" in missing and (folder / "config.json").exists()
        config = ModularDecoderConfig.from_pretrained(folder) if writes_card else None
    if writes_card:  # uploaded beside the folder, written into it only once the push succeeded
        card = render_model_card(config, base_model=args.base_model, repo_id=args.repo_id)
        missing.remove("README.md")
    if missing:
        raise UserError(f"{folder} is not a complete modular_decoder repository; missing: {', '.join(missing)}")
    api = HfApi(token=args.token)
    with user_input(OSError):  # the Hub's answers (authentication, network, a refused name) are HTTP errors
        url = api.create_repo(args.repo_id, private=args.private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=args.repo_id, repo_type="model",
                          revision=args.revision, commit_message=args.commit_message)
        if writes_card:
            api.upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id=args.repo_id,
                            repo_type="model", revision=args.revision, commit_message="Add the model card")
    print(f"pushed {folder} -> {url}")
    if writes_card:
        (folder / "README.md").write_text(card)
        print(f"wrote the model card it pushed: {folder / 'README.md'}")
    return 0
