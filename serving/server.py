"""Running the app: `jaxdecode serve` (`main(args)`), and `ServerThread` for tests and notebooks.

    jaxdecode serve --model DIR|demo --host 127.0.0.1 --port 8000 --max-slots N --max-len N
                    [--api-key KEY] [--on-disconnect cancel|continue] [--max-queue N]
                    [--max-num-beams B] [--max-n N] [--max-constraint-compile-s S]
                    [--max-constraint-states S]
                    [--model-name NAME] [--record-dir DIR] [--log-prompts] [--max-body-bytes N] [--warmup]
                    [--speculative prompt_lookup|demo-draft|DIR] [--num-speculative-tokens K]
                    [--mesh data=N,model=M] [--distributed [--coordinator-address HOST:PORT
                     --num-processes N --process-id I]]

The server binds 127.0.0.1 unless told otherwise; the api key may also come from the
JAXDECODE_API_KEY environment variable. Logs are JSON lines on stderr (`serving.logs`).
`--distributed` (serving/distributed.py, serving/README.md): every host runs the same command;
process 0 serves HTTP and broadcasts its step ops, the others replay them.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from typing import Any, Optional


# per-request bounds (docs/serving.md "One bad request never hurts another"): jd.LLM options
LIMIT_FLAGS = (
    ("--max-num-beams", int, "largest num_beams accepted (default 16)"),
    ("--max-n", int, "largest n accepted (default 128, at most --max-queue)"),
    ("--max-constraint-compile-s", float, "time budget of one response_format compile in "
     "seconds (default 30; 400 above it)"),
    ("--max-constraint-states", int, "automaton state cap of one response_format "
     "(default 20000; 400 above it)"))


def kv_options(args: Any, model: Any, params: Any, speculative: Optional[dict]) -> dict:
    """The engine's KV options from --page-size, --prefill-chunk, --kv-cache-memory,
    --kv-cache-dtype and --no-prefix-cache: the memory budget in bytes becomes a number of
    pages (keys and values of every layer -- int8 codes and their scales with --kv-cache-dtype
    int8 -- the draft's too; ValueError naming kv_cache_memory when it holds none)."""
    from jaxdecode.model_api import params_dtype

    page_size = args.page_size
    options = {"page_size": page_size, "prefix_cache": not args.no_prefix_cache,
               "prefill_chunk": None if args.prefill_chunk == 0 else args.prefill_chunk,
               "kv_cache_dtype": args.kv_cache_dtype}
    if args.kv_cache_memory is not None:
        kv_dtype = args.kv_cache_dtype
        per_page = kv_page_bytes(model, params_dtype(params), page_size, kv_dtype)
        draft = (speculative or {}).get("draft")
        if isinstance(draft, tuple):
            per_page += kv_page_bytes(draft[0], params_dtype(draft[1]), page_size, kv_dtype)
        pages = args.kv_cache_memory // per_page
        if pages < 1:
            raise ValueError(f"kv_cache_memory: {args.kv_cache_memory} bytes hold no page of "
                             f"{per_page} bytes")
        options["kv_pages"] = int(pages)
    return options


def kv_page_bytes(model: Any, dtype: Any, page_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV page: keys and values of every layer and kv head, in the weights'
    `dtype` or, with `kv_cache_dtype` "int8", int8 codes and their scales
    (jaxdecode/kv_int8.py)."""
    from jaxdecode import kv_int8

    c = model.config
    return page_size * kv_int8.position_bytes(c.num_layers, c.num_kv_heads, c.head_dim,
                                              kv_int8.pool_dtype(kv_cache_dtype, dtype))


def serve_app(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
              access_log: bool = True) -> None:
    """Run `app` with uvicorn in this thread until interrupted (logging left to the caller)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_config=None, log_level=log_level,
                access_log=access_log, timeout_graceful_shutdown=5)


class ServerThread:
    """uvicorn serving `app` on a loopback socket in a daemon thread.

        with ServerThread(app) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_config=None, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=2, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="jaxdecode-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def engine_config(args: Any, model: Any, params: Any, speculative: Optional[dict],
                  params_hash: Optional[str] = None) -> Any:
    """The `jd.EngineConfig` that serve's flags say (ValueError naming the field)."""
    from jaxdecode.engine import EngineConfig

    names = [flag[2:].replace("-", "_") for flag, _, _ in LIMIT_FLAGS]
    limits = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    return EngineConfig(max_slots=args.max_slots,
                        max_len=args.max_len or min(model.config.max_len, 4096),
                        max_queue=args.max_queue, model_source=args.model,
                        params_hash=params_hash, decode_steps=args.decode_steps,
                        row_tile=args.row_tile, batch_invariant=args.batch_invariant,
                        lora_modules=lora_modules(args.lora_modules), max_loras=args.max_loras,
                        **limits, **kv_options(args, model, params, speculative))


def lora_modules(entries: Optional[list]) -> Optional[dict]:
    """--lora-modules NAME=PATH ... as {name: path} (None without the flag); ValueError naming
    lora_modules for an entry without '='."""
    if not entries:
        return None
    out = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: expected NAME=PATH, got {entry!r}")
        out[name] = path
    return out


def _placement(args: Any, params: Any, distributed: bool) -> tuple:
    """(mesh, params, params_hash): the params sharded over --mesh (one mesh over every host's
    devices with --distributed, hashed on process 0 while whole); (None, params, None) else."""
    if not (getattr(args, "mesh", None) or distributed):
        return None, params, None
    import jax

    from jaxdecode.replay import params_hash as hash_params
    from models.sharding import make_mesh, parse_mesh, shard_params
    try:
        mesh = parse_mesh(args.mesh) if args.mesh else make_mesh(data=1)
    except ValueError as e:
        raise SystemExit(f"--mesh: {e}")
    params_hash = hash_params(params) if distributed and jax.process_index() == 0 else None
    return mesh, shard_params(params, mesh), params_hash


def _app(args: Any, llm: Any, spec_setting: Any) -> Any:
    from serving.app import create_app

    name = args.model_name or (args.model if args.model == "demo"
                               else os.path.basename(os.path.normpath(args.model)))
    api_key: Optional[str] = args.api_key or os.environ.get("JAXDECODE_API_KEY") or None
    return create_app(llm, model_name=name, api_key=api_key, on_disconnect=args.on_disconnect,
                      max_body_bytes=args.max_body_bytes, log_prompts=args.log_prompts,
                      record_dir=args.record_dir, close_llm_on_shutdown=True,
                      speculative=spec_setting), name, api_key


def main(args: Any) -> int:
    """`jaxdecode serve`: load the model, build the engine and the app, serve until Ctrl-C."""
    from serving.loading import flag_error, load_model, speculative_from_args
    from jaxdecode.engine import LLM
    from jaxdecode.invariance import mode_of as invariance_mode
    from serving.logs import configure_logging, log_event

    configure_logging(args.log_level)
    distributed = getattr(args, "distributed", False)
    if distributed:
        import jax

        from serving import distributed as dist
        dist.initialize(args)  # before anything touches a device
    model, params, tokenizer = load_model(args.model, quantization=args.quantization)
    if tokenizer is None:
        raise SystemExit(f"--model: {args.model!r} has no tokenizer files; the server needs one")
    speculative, spec_setting = speculative_from_args(args, model, tokenizer)
    if speculative and args.record_dir:
        raise SystemExit("--record-dir: not with --speculative (a record does not pin the "
                         "speculative setting, so replay would run a plain engine)")
    mesh, params, params_hash = _placement(args, params, distributed)
    hook = dist.CollectiveBroadcaster() if distributed else None
    try:
        config = engine_config(args, model, params, speculative, params_hash)
        llm = LLM(model, params, tokenizer, config=config, mesh=mesh, speculative=speculative,
                  step_hook=hook)
    except ValueError as e:  # on every process: a follower never waits for a failed leader
        raise flag_error(e)
    if distributed and jax.process_index() != 0:  # built only to check the flags
        log_event("follower.start", process=jax.process_index(), devices=jax.device_count())
        applied = dist.run_follower(llm.model, params, hook, max_slots=llm.max_slots,
                                    max_len=llm.max_len, eos_token_ids=llm.eos_token_ids,
                                    mesh=mesh, pages=llm.kv.pages, page_size=llm.kv.page_size,
                                    kv_cache_dtype=llm.config.kv_cache_dtype)
        log_event("follower.stop", process=jax.process_index(), ops=applied)
        return 0
    if args.warmup is not None:
        t0 = time.perf_counter()
        compiled = llm.warmup(args.warmup)
        log_event("engine.warmup", compilations=compiled,
                  seconds=round(time.perf_counter() - t0, 3))
    app, name, api_key = _app(args, llm, spec_setting)
    log_event("server.start", model=name, host=args.host, port=args.port,
              max_slots=config.max_slots, max_len=config.max_len, max_queue=config.max_queue,
              auth=api_key is not None, on_disconnect=args.on_disconnect,
              speculative=spec_setting, row_tile=getattr(llm.model, "row_tile", None),
              batch_invariance=invariance_mode(llm.model))
    try:
        serve_app(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        llm.close()
        if hook is not None:  # the engine thread has stopped: the followers may return
            from jaxdecode.engine import step_ops
            hook.publish(step_ops.stop())
    return 0


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the flag in its error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(p: Any) -> None:
    """The server's flags, speculative decoding's included: `jaxdecode serve` and
    `python -m serving` (serving/__main__.py) take the same."""
    from serving.loading import (add_batch_invariance_argument, add_kv_cache_dtype_argument,
                                 add_quantization_argument, add_speculative_arguments)

    p.add_argument("--model", default="demo", help="a local HF checkpoint directory, or 'demo'")
    _add_http_arguments(p)
    _add_engine_arguments(p)
    _add_placement_arguments(p)
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"))
    add_speculative_arguments(p)
    add_batch_invariance_argument(p)
    add_quantization_argument(p)
    add_kv_cache_dtype_argument(p)


def _add_engine_arguments(p: Any) -> None:
    """The flags `engine_config` turns into a `jd.EngineConfig`."""
    p.add_argument("--max-slots", type=int, default=8, help="concurrent sequences in the batch")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per sequence, prompt + output (default: the model's, <= 4096)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="admission queue bound; a full queue answers 429")
    for flag, kind, text in LIMIT_FLAGS:  # unset: the engine's defaults (jd.LLM options)
        p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument("--page-size", type=int, default=16,
                   help="positions per KV page (divides --prefill-chunk; default 16)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens prefilled per engine iteration, in page-aligned chunks "
                        "(0: whole prompts; default 256)")
    p.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                   help="the KV cache's memory budget in bytes, as pages (default: "
                        "--max-slots rows of --max-len positions)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="turn automatic prefix caching off (on by default)")
    p.add_argument("--decode-steps", type=int, default=1,
                   help="decode steps per device call while no request waits (jd.LLM's "
                        "decode_steps; default 1: an arrival waits for one step, not several)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT LoRA adapters of the model (Llama family), each served as model "
                        "NAME beside the base (/v1/models lists them; a request's 'model' "
                        "selects one; contract R6)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapters resident (default: those of --lora-modules)")
    p.add_argument("--row-tile", type=int, default=None,
                   help="rows per weight-product tile (jd.LLM's row_tile; default: the "
                        "model's, 4). Wider tiles speed up full batches and slow a lone "
                        "stream: --row-tile 16 with --max-slots 16 on a busy server "
                        "(docs/batch_invariance.md \"Row tiles as a setting\")")


def _add_http_arguments(p: Any) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (also $JAXDECODE_API_KEY); "
                        "/health stays open")
    p.add_argument("--on-disconnect", choices=("cancel", "continue"), default="cancel",
                   help="what a client disconnect does to its request (default: cancel)")
    p.add_argument("--model-name", default=None,
                   help="the name clients use in 'model' (default: 'demo' or the directory name)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="request body limit (413 above it)")
    p.add_argument("--record-dir", default=None,
                   help="write each request's generation record (contract §11) as <id>.json here")
    p.add_argument("--log-prompts", action="store_true",
                   help="include prompts and outputs in the logs (off by default)")
    p.add_argument("--warmup", nargs="?", type=positive_int, const=64, default=None,
                   metavar="MAX_PROMPT_TOKENS",
                   help="compile every engine shape for prompts up to MAX_PROMPT_TOKENS "
                        "(default 64) before accepting requests; a longer prompt compiles "
                        "its prefill programs when it first arrives")


def _add_placement_arguments(p: Any) -> None:
    p.add_argument("--mesh", default=None, metavar="data=N,model=M[,expert=E]",
                   help="shard over a device mesh (docs/sharding.md); default: one device")
    p.add_argument("--distributed", action="store_true",
                   help="multi-host: jax.distributed.initialize(); process 0 serves HTTP, the "
                        "others replay its steps (serving/README.md)")
    p.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="with --distributed: process 0's address (default: auto-detected)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="with --distributed: how many processes (default: auto-detected)")
    p.add_argument("--process-id", type=int, default=None,
                   help="with --distributed: this process's index (default: auto-detected)")
