"""Cell sources of notebooks/*.ipynb; tools/build_notebooks.py turns each module's INTRO and CELLS into a
notebook. Each module: INTRO (markdown after the badge) and CELLS, a list of ("md" | "code", text)."""
