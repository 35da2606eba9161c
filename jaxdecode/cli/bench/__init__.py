"""`jaxdecode bench`: decode throughput measured side by side in one run.

Figures are ratios taken in the same process on the same weights: jaxdecode's on-device loop
against Hugging Face PyTorch `generate`, and the batch-1 step time against the memory-bandwidth
roofline (parameter bytes read per step / a measured GEMV bandwidth). Performance goals live
here, never in timed unit tests.

Runners (each returns a JSON-able dict or list): `timing` (shared helpers, `BenchConfig`),
`throughput` (decode tokens/s vs HF, time to first token), `search` (beam search, speculative
decoding), `host` (pipeline cost, engine vs raw loop, recompilations), `structured` (constraint
step time and compile time), `research` (custom processors and hidden-state capture). `report` formats and writes the report, `plots` draws it,
`configs` builds the measured models, `command` is the subcommand.
"""

from jaxdecode.cli.bench.command import add_parser, cmd_bench
from jaxdecode.cli.bench.host import engine_vs_raw, host_cost, recompiles_after_warmup
from jaxdecode.cli.bench.report import (format_constraints_table, format_search, format_table,
                                        write_report)
from jaxdecode.cli.bench.research import format_research_table, time_research
from jaxdecode.cli.bench.search import CODE_EDIT_PROMPT, time_beam_search, time_speculative
from jaxdecode.cli.bench.structured import CONSTRAINT_SCHEMAS, time_constraints
from jaxdecode.cli.bench.throughput import run, time_hf, time_jaxdecode, ttft
from jaxdecode.cli.bench.timing import BenchConfig, gemv_bandwidth, machine, step_bytes

__all__ = ["BenchConfig", "CODE_EDIT_PROMPT", "CONSTRAINT_SCHEMAS", "add_parser", "cmd_bench",
           "engine_vs_raw", "format_constraints_table", "format_research_table", "format_search",
           "format_table", "gemv_bandwidth", "host_cost", "machine", "recompiles_after_warmup",
           "run", "step_bytes", "time_beam_search", "time_constraints", "time_hf",
           "time_jaxdecode", "time_research", "time_speculative", "ttft", "write_report"]
