"""`epp bench soak`: hours of traffic compressed into minutes at the measured ceiling."""
