"""Research harness beside the library (not installed): commands that check docs against the committed records."""
