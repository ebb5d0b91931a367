"""KV transports behind one interface, selected by kebab-case id (`--kv-transport`)."""
