"""The router as the endpoint picker (EPP) of the Gateway API Inference Extension.

`radixmesh router --epp-port P` also serves Envoy's external processing service
(envoy.service.ext_proc.v3.ExternalProcessor) on P, as the extension's endpoint-picker protocol
asks: a proxy (Envoy Gateway, kgateway, Istio, GKE's inference gateway) streams each request's
headers and buffered body to it; the picker tokenizes the prompt through the tokenizer service,
picks a worker with the router's own policy (the prompt's blocks against the KV-cache index, and
load) and answers with the worker's HTTP endpoint in the `x-gateway-destination-endpoint` header
and the `envoy.lb` dynamic metadata. The proxy then sends the request to that worker's OpenAI API
(`worker --http-port`).

    config.py    EppConfig: the flags
    prompt.py    the prompt of an OpenAI / native request body, as the tokenizer service takes it
    tokens.py    Tokenize calls (token ids and block hashes)
    picker.py    candidates (ready, serving HTTP, in the subset hint), shedding, the policy's pick
    wire.py      ext_proc messages in and out (headers, subset hint, pick, immediate responses)
    service.py   the ExternalProcessor stream of one HTTP request
    server.py    the port: ext_proc plus grpc.health.v1 (liveness and readiness)
    metrics.py   pick latency and picks by result
"""
