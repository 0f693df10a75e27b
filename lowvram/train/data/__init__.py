"""The training data: read (read.py), format (format.py), tokenize (tokenize.py), pack and
collate (collate.py); build.py runs them for a recipe."""
