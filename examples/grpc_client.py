"""A short client of radixmesh's public gRPC API (radixmesh.v1.InferenceService).

    radixmesh serve --grpc-port 50050 &
    python examples/grpc_client.py --target 127.0.0.1:50050 "What is the capital of France?"

With TLS and API keys on the server (`--tls-cert/--tls-key`, `--api-key-file`):

    python examples/grpc_client.py --target llm.example.com:50050 --ca ca.crt --api-key "$KEY" "Hello!"

The messages come with the `radixmesh` package (radixmesh.protocol); other languages generate them
from proto/radixmesh/v1/inference.proto, or discover them through server reflection.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from radixmesh.protocol import inference_pb2 as pb
from radixmesh.protocol import inference_pb2_grpc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question")
    parser.add_argument("--target", default="127.0.0.1:50050", help="host:port of the gRPC API")
    parser.add_argument("--ca", default=None, help="CA certificate (PEM) of a server with TLS")
    parser.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer <key>'")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    if args.ca:
        with open(args.ca, "rb") as ca:
            channel = grpc.secure_channel(args.target, grpc.ssl_channel_credentials(ca.read()))
    else:
        channel = grpc.insecure_channel(args.target)
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    stub = inference_pb2_grpc.InferenceServiceStub(channel)

    request = pb.ChatRequest(messages=[pb.ChatTurn(role="user", content=args.question)],
                             options=pb.GenerationOptions(temperature=0, max_tokens=args.max_tokens))
    try:
        model = stub.ListModels(pb.ListModelsRequest(), metadata=metadata).models[0]
        print(f"model: {model.id} (context {model.max_model_len} tokens)")
        for message in stub.StreamChat(request, metadata=metadata):   # deltas; the last one carries usage
            for choice in message.choices:
                print(choice.content, end="", flush=True)
            if message.HasField("usage"):
                u = message.usage
                print(f"\n[{u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
                      f"{u.completion_tokens} generated]")
    except grpc.RpcError as exc:                                      # UNAUTHENTICATED, INVALID_ARGUMENT, ...
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
