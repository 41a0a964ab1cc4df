"""Config of the embedded generation server (``areal serve``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from areal.api.config.loader import param
from areal.utils.http_guard import allowed_host_problems, is_loopback


@dataclass(frozen=True)
class GenerationServerConfig:
    """An HTTP server speaking SGLang's native API plus OpenAI completions/chat."""

    model_path: str = param(
        "",
        help="Hugging Face model dir (config, safetensors, tokenizer); required by `areal serve` "
        "(the launcher passes the actor's path).",
    )
    served_model_name: str = param("", help="Name reported by /v1/models; empty = model_path.")
    host: str = param("127.0.0.1", help="Bind address; a non-loopback bind requires api_key.")
    port: int = param(30000, ge=0, le=65535, help="TCP port; 0 picks a free one (printed).")
    api_key: str = param(
        "",
        secret=True,
        help="Bearer key for admin endpoints (weight updates, pause, flush); empty = none. Prefer "
        "the AREAL_SERVER_API_KEY env variable (read when this is empty): a key on a command "
        "line is visible to every user of the machine. Never written to RUN_DIR.",
    )
    allowed_hosts: list[str] = param(
        [],
        help="Host names clients and browser pages may use for this server besides IP literals, "
        "localhost, the bind address and this machine's names (docs/security.md): a request whose "
        "Host header names another gets HTTP 403 (DNS rebinding), and a browser page of another "
        "origin may not call POST or admin routes. Bare names (gpu-3.example.com); '*' = any.",
    )
    device: str = param("cpu", help="torch device: cpu, cuda, cuda:1, ...")
    gpu_memory_fraction: float = param(
        0.0,
        ge=0.0,
        le=1.0,
        help="On CUDA, the most of its GPU's memory this server may take "
        "(weights, KV cache, activations); set it when the server shares the GPU with a trainer "
        "(cluster.colocate), e.g. 0.3; a model that does not fit fails at start naming this field. "
        "0 = no cap.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = param(
        "float32", help="Weight and KV-cache dtype (fp32 on CPU)."
    )
    max_batch_size: int = param(32, ge=1, help="Most requests decoded together (cache slots).")
    max_n: int = param(
        256,
        ge=1,
        help="Most completions one HTTP request may ask for (prompts x n); more gets "
        "HTTP 400 naming n, before any prompt is tokenized.",
    )
    context_length: int = param(
        0, ge=0, help="Max prompt + completion tokens; 0 = the model's max_position_embeddings."
    )
    max_prefill_tokens: int = param(
        8192,
        ge=1,
        help="Prompt-token budget admitted into one step (the first prompt always fits).",
    )
    share_prompts: bool = param(
        True,
        help="Requests admitted in one step with the same prompt (a group's samples) prefill "
        "it once and copy its cache rows; false = one prefill per request (same outputs, slower).",
    )
    prefix_cache_tokens: int = param(
        16384,
        ge=0,
        help="Tokens whose keys/values are kept across requests (the prefix cache: prompts, and "
        "outputs once answered), so a request starting with whole blocks of an earlier one (the "
        "next turn of a conversation, another sample of a GRPO group) prefills only the rest; "
        "least recently used blocks go first, every weight update and memory release drops "
        "all. Memory: this x 2 x layers x kv_heads x head_dim x dtype bytes at most, allocated "
        "as used. 0 = off (same outputs to float rounding). /metrics reports the hit rate.",
    )
    prefix_cache_block: int = param(
        16, ge=1, help="Tokens per prefix-cache block: prefixes are matched in whole blocks."
    )
    stats_log_interval: float = param(
        30.0,
        ge=0,
        help="Seconds between server log lines with the running and waiting requests and the "
        "prefix cache's hit rate (only when requests were served since the last); 0 = none.",
    )
    cpu_attention: Literal["auto", "compiled", "torch"] = param(
        "auto",
        help="Decode attention on CPU fp32: compiled = a C kernel built with $CC (default cc) at "
        "start (kept in $AREAL_CACHE_DIR/kernels, default ~/.cache/areal/kernels, for the next "
        "start), an error if it cannot be built; torch = batched matmuls; auto = compiled if it "
        "builds, else torch with a warning. /get_server_info reports decode_attention.",
    )
    compile: Literal["auto", "on", "off"] = param(
        "auto",
        help="Decode steps with no prompt joining run a static-shape step (batch padded to a "
        "decode bucket, attention over the whole cache under a length mask) compiled by "
        "torch.compile (inductor). auto = on for CUDA, off on CPU: there inductor takes 20-60 s "
        "per compiled shape class on 2 cores even for a tiny model, and the compiled step ran at "
        "0.45x the eager one's tok/s (bench/gpu_engine.py; the eager CPU step, a C attention "
        "kernel over each row's own length and packed oneDNN matmuls, is not launch-bound). "
        "Qwen3-MoE decodes eagerly (on is an error: its expert routing has data-dependent shapes).",
    )
    cuda_graphs: Literal["auto", "on", "off"] = param(
        "auto",
        help="On CUDA, capture the static decode step as one CUDA graph per decode bucket and "
        "replay it each step (weight updates copy in place, so graphs stay valid; release_memory "
        "drops them, recaptured at the next step). auto = on for CUDA; on off CUDA is an error.",
    )
    decode_buckets: list[int] = param(
        [],
        help="Batch sizes the static decode step pads to (each 1..max_batch_size; max_batch_size "
        "is always one); [] = 1, 2, 4, ... up to max_batch_size.",
    )
    seed: int = param(
        0,
        ge=0,
        help="Seeds the server's stream of sampling keys for requests without a seed, mixed "
        "with the process id so the servers of a run differ (a seeded request draws from its own "
        "seed, the same alone or in a batch).",
    )
    weight_version: int = param(
        0,
        ge=0,
        help="Version stamped on tokens until the first weight update (a restarted "
        "server passes the version of the weights it loads).",
    )
    max_body_bytes: int = param(
        32 << 20,
        ge=1024,
        help="Largest request body in bytes; a longer one gets HTTP 413 (body) before it is read.",
    )
    max_text_chars: int = param(
        1_000_000,
        ge=1,
        help="Most characters in all the strings of one request body together "
        "(text prompts, messages, tools, stop strings), counted before anything is tokenized; more "
        "gets HTTP 400 naming the field that crossed it.",
    )
    max_json_depth: int = param(
        64,
        ge=2,
        help="Deepest nesting of arrays and objects in a request body (a tools schema "
        "included); deeper gets HTTP 400.",
    )
    max_stop_strings: int = param(
        64,
        ge=1,
        help="Most stop strings one request may send (each is searched for at every "
        "decode step); more gets HTTP 400 naming stop.",
    )
    max_stop_chars: int = param(
        4096,
        ge=1,
        help="Most characters of one request's stop strings together; more gets HTTP "
        "400 naming stop.",
    )
    max_prompt_logprob_tokens: int = param(
        16384,
        ge=1,
        help="Most prompt tokens one request may ask logprobs of (OpenAI echo + "
        "logprobs, /generate logprob_start_len), over its prompts together: each costs a forward "
        "pass between decode steps; more gets HTTP 400 naming logprobs (logprob_start_len).",
    )
    max_grammar_chars: int = param(
        100_000,
        ge=1,
        help="Most characters of one structured-output grammar (a JSON schema, regex, "
        "Lark/GBNF grammar, choice list, or a forced tool call's tools); longer gets HTTP 400 "
        "naming the field before anything is compiled.",
    )
    grammar_compile_timeout: float = param(
        10.0,
        gt=0,
        help="Seconds a request waits for a free grammar compile thread (then HTTP 503 with "
        "Retry-After: other requests' grammars hold them all), and then as long again for its own "
        "grammar to compile (then HTTP 400 naming the field). Compiles run on "
        "grammar_compile_threads threads, never the event loop or the decode loop.",
    )
    grammar_lexer_fuel: int = param(
        1_000_000,
        ge=1000,
        help="llguidance's lexer fuel, the work one grammar may spend building "
        "its lexer at compile time and at each decode step (a catastrophic regex runs out of it): "
        "past it the request gets HTTP 400 naming the field, alone.",
    )
    grammar_cache_size: int = param(
        256,
        ge=1,
        help="Compiled grammars kept (newest used first); a request with a cached grammar "
        "skips the compile.",
    )
    grammar_compile_threads: int = param(
        2,
        ge=1,
        help="Threads compiling structured-output grammars, so one slow grammar holds one "
        "thread, not every structured request; a request whose grammar is cached never waits "
        "for them.",
    )
    max_queued_grammars: int = param(
        16,
        ge=0,
        help="Most grammar compiles waiting for a compile thread (requests sending the same "
        "grammar share one); past it a request needing a new compile gets HTTP 503 with "
        "Retry-After, at once.",
    )
    json_schema_additional_properties: bool = param(
        False,
        help="What a JSON schema's object that names properties but leaves "
        "additionalProperties unset allows (response_format, structured_outputs.json, "
        "sampling_params.json_schema, tool parameters): false (vLLM's and SGLang's reading) "
        "only the named keys, so a model cannot invent keys until max_tokens; true (JSON "
        "Schema's own default) any others too. A schema that sets additionalProperties keeps it.",
    )
    parse_threads: int = param(
        2,
        ge=1,
        help="Threads decoding, rendering (chat templates) and tokenizing request bodies "
        "longer than parse_small_body_bytes, off the event loop.",
    )
    parse_small_body_bytes: int = param(
        65536,
        ge=0,
        help="Bodies up to this many bytes are parsed on a thread of their own, so a short "
        "request never waits behind the tokenizing of long ones.",
    )
    max_queued_parses: int = param(
        8,
        ge=0,
        help="Most long bodies (past parse_small_body_bytes) waiting for a parse thread; past "
        "it a long request gets HTTP 503 with Retry-After, at once.",
    )
    request_parse_timeout: float = param(
        30.0,
        gt=0,
        help="Seconds a request's body may take to be parsed and tokenized, queueing for a "
        "parse thread included; then HTTP 503 with Retry-After (the server is busy).",
    )
    request_head_timeout: float = param(
        30.0,
        gt=0,
        help="Seconds a connection may take to send a complete request head, counted "
        "from its opening or its previous response (so also how long an idle keep-alive "
        "connection stays open); then it is closed.",
    )
    request_body_timeout: float = param(
        60.0,
        gt=0,
        help="Seconds to receive a request's body once its head arrived; then HTTP "
        "408 and the connection is closed.",
    )
    max_connections: int = param(
        1000,
        ge=1,
        help="Most open client connections. A new one past this closes an open one not "
        "inside a request (first the longest-open one that never completed a request, as a "
        "flood's are, then the least recently used keep-alive one), or is closed itself when "
        "all are inside requests; capped below the open-file limit (raised to its hard limit at "
        "start) so accept never runs out of descriptors. control_connections of them are kept "
        "for /health, the info and the admin routes.",
    )
    control_connections: int = param(
        32,
        ge=1,
        help="Of max_connections, how many are kept for /health, /health_generate, "
        "/get_model_info, /get_server_info, /v1/models and the admin routes: when the other "
        "max_connections - control_connections connections are all inside generation or "
        "tokenizer requests, a further such request gets HTTP 503 with Retry-After (clients "
        "retry it), and those routes still answer.",
    )
    weight_read_timeout: float = param(
        600.0,
        gt=0,
        help="Seconds /update_weights_from_disk may take to read the weight files (regular "
        "files inside model_path only, at most 16 bytes a parameter; read on a worker thread, "
        "so /health keeps answering); past it HTTP 400 naming the file, old weights kept.",
    )
    shutdown_timeout: float = param(
        10.0, gt=0, help="Seconds to finish answering in-flight requests on SIGTERM."
    )
    log_level: Literal["debug", "info", "warning", "error"] = param("info", help="Log level.")

    def check(self) -> Iterator[str]:
        if self.api_key and not self.api_key.strip():
            yield (
                f"api_key: {self.api_key!r} is blank (whitespace only), which no client should "
                "send as a key; set a real key (AREAL_SERVER_API_KEY) or none on a loopback bind"
            )
        elif not is_loopback(self.host) and not self.api_key:
            yield (
                f"api_key: binding non-loopback host {self.host!r} needs an API key for the "
                "admin endpoints; pass --api-key KEY or bind 127.0.0.1"
            )
        yield from allowed_host_problems("allowed_hosts", self.allowed_hosts)
        if self.control_connections >= self.max_connections:
            yield (
                f"control_connections: {self.control_connections} leaves none of "
                f"max_connections={self.max_connections} for generation; set it below "
                "max_connections (default 32)"
            )
        if self.cuda_graphs == "on" and not self.device.startswith("cuda"):
            yield (
                f"cuda_graphs: on needs a CUDA device, got device={self.device!r}; use auto "
                "(on for CUDA only) or off"
            )
        bad = [b for b in self.decode_buckets if not 1 <= b <= self.max_batch_size]
        if bad:
            yield (
                f"decode_buckets: {bad} outside 1..max_batch_size ({self.max_batch_size}); list "
                "sizes in that range, or [] for powers of two"
            )
        if 0 < self.prefix_cache_tokens < self.prefix_cache_block:
            yield (
                f"prefix_cache_tokens: {self.prefix_cache_tokens} holds no block of "
                f"prefix_cache_block={self.prefix_cache_block} tokens; raise it, or set 0 to turn "
                "the prefix cache off"
            )
        if self.dtype != "float32" and self.device == "cpu":
            yield f"dtype: {self.dtype} on CPU is slow and inexact; use float32 on CPU"
