"""The gRPC tokenizer service: tokenize once at the edge, detokenize streams incrementally."""
