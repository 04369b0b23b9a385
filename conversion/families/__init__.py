"""One module per source family; each exposes `FAMILY` (a `conversion.core.Family`)."""
