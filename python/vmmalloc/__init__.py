"""vmmalloc from Python (placeholder: the package's real modules come from the python/ work)."""
