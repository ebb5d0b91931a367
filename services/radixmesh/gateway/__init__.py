"""The HTTP gateway: OpenAI-compatible and SGLang-native APIs over a GatewayBackend."""
