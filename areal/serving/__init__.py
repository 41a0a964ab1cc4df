"""Embedded generation: continuous-batching generator (``generator``) and ``areal serve``
(``server``), speaking SGLang's native HTTP API plus OpenAI completions/chat."""
