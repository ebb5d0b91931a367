"""The grammar service: structured-output grammars compiled once per content, shared via Redis."""
