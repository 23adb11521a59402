"""The operator surface: health, stats, metrics, config reload, session close and
the live dashboard, with the admin token that guards them."""
