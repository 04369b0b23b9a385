"""Library tools around the model code, never shipped as remote code: presets of published layouts,
the validation checklist, model cards, Hub folders and the seed's experiments."""
