class ToolError(Exception):
    """A user-facing failure: printed as one line, exit status 1, no traceback."""
