"""`klein serve`: an HTTP images API over one pipeline (docs/design/serving.md, "Serving")."""
