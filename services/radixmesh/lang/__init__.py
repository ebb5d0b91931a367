"""radixmesh.lang: programs of LLM calls (gen, select, fork, chat roles) run against a radixmesh server.

    from radixmesh.lang import RuntimeEndpoint, assistant, function, gen, set_default_backend, user

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    set_default_backend(RuntimeEndpoint("http://127.0.0.1:8000"))
    print(qa.run(question="What is a radix tree?")["answer"])

The calls of one program share its growing prefix, which the server's radix cache reuses.
See docs/lang.md.
"""

from radixmesh.lang.backend import BaseBackend, GenResult, SelectResult, get_default_backend, set_default_backend
from radixmesh.lang.ir import assistant, gen, select, system, user
from radixmesh.lang.program import Program, function
from radixmesh.lang.runtime_endpoint import RuntimeEndpoint
from radixmesh.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "BaseBackend", "GenResult", "Program", "ProgramState", "ProgramStateGroup", "RuntimeEndpoint", "SelectResult",
    "assistant", "function", "gen", "get_default_backend", "select", "set_default_backend", "system", "user",
]
