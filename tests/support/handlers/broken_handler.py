"""A handler module whose import fails, as user code sometimes does."""

raise RuntimeError("this module is broken on purpose")
