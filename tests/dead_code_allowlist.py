"""Names the dead-code check (tests/test_dead_code.py, vulture) must treat as used, each with
the reason it stays. Keep this list short: anything else vulture reports is removed."""

# ruff: noqa
_ = object()

# Parameters a caller's signature requires even though the body ignores them.
is_causal  # transformers' AttentionInterface signature (engine/attention.py varlen_attention)
frame  # signal handler signature (launcher/common.py)
exc  # __exit__ signature (launcher/procs.py, reward/runner.py)

# Attributes set on objects another library reads.
_.num_labels  # transformers config: one-output value head (engine/fsdp.py)
_.classifier_dropout  # transformers config
_.use_cache  # transformers config
_.architectures  # transformers config: what an HF export loads as (engine/fsdp.py)
_.pre_tokenizer  # tokenizers objects of the tiny model (utils/tiny_model.py)
_.decoder
_.chat_template
_.generation_config
_.__cause__  # exception chaining read by the trainer's traceback (rollout/executor.py)
yaml_implicit_resolvers  # read by PyYAML's Resolver (api/config/loader.py)
__getattr__  # a module's lazy attributes, called by Python (PEP 562; workflow/__init__.py)

# The launch env contract names what torchrun sets; torch.distributed's env:// rendezvous reads them.
MASTER_ADDR
MASTER_PORT

# Reference paths for equivalence tests (STYLE 17): padded vs packed, one rank vs a DP split.
_.to_padded
_.from_padded
balance_across_ranks

# Keys of a TypedDict that argparse's add_argument(**kw) reads (areal/cli.py ArgKeywords).
dest
metavar
nargs
required

# Agent API: agents call it on their client to give one call its own reward (workflow/openai_client.py).
_.set_reward

# vLLM's worker calls them by name: --worker-extension-cls and POST /collective_rpc (launcher/vllm_ext).
WeightReload
_.areal_reload_weights
_.areal_init_weight_group
_.areal_update_weights_from_distributed

# pickle.Unpickler's hook, called by load() (utils/weight_sync.py _HandleUnpickler: the ipc allowlist).
_.find_class

# Called on Ray actor handles (.collective_counts.remote()): which process groups a step used (core/ray_worker.py).
_.collective_counts

# Keys of the TypedDict core/status.ScaleRequest (RUN_DIR/core_scale.json), read as req["..."].
add_servers
remove_servers
# WorkerCounts fields are read through vars() into stats (core/manager.py).
reclaimed
_.reclaimed

# Called on Core actor handles by name through ask("...") (core/rollout_side.py): the manager's
# holds, and the rollout workers' steps of a weight update (pause, begin, join, done, resume).
_.holds
_.pause_servers
_.begin_update
_.begin_join
_.update_done
_.resume_servers
_.resume_at

# A type-checking-only import named in a string bound (api/config/loader.py's TypeVar T).
DataclassInstance

# Set on an HF model and read by its own forward: a pipeline stage's rebuilt rotary embedding
# (engine/pipeline.py; its inv_freq is a non-persistent buffer the checkpoint lacks).
_.rotary_emb

# Keys of the TypedDict serving/tokens.Tokenized: the /tokenize answer, read by HTTP clients.
max_model_len
token_strs
# A callback protocol's signature (utils/recover.AllGather): Ranks.all_gather is called through it.
_.__call__
# A config field read by name from __init__'s keywords, never as an attribute: the preset that
# fills actor.rollout_correction's knobs (api/config/actor.py _with_preset); saved configs keep it.
preset

# Model functions: engine methods an MFC calls by name (areal/api/mfc.py ModelFn; runtime/step.py
# call_mfc), and the ModelFn members naming functions no built-in graph calls yet.
_.ppo_update
_.compute_values
_.train_lm
_.train_rw
_.train_dpo
EVALUATE_LM
SCORE

# The environment hubs' classes and functions in examples/ (docs/environments.md): named by
# workflow.env / dataset paths as strings; verifiers finds @vf.reward / @vf.tool methods by their
# decorator, and openenv's server reads SUPPORTS_CONCURRENT_SESSIONS.
GuessEnv
SUPPORTS_CONCURRENT_SESSIONS
_.correct
_.multiply
sum_taskset
calc_taskset
