"""Library tools around the model code, never shipped as remote code: presets of published layouts,
the validation checklist, model cards, Hub folders, the seed's experiments and the README's table of
attention backends."""
