"""The measuring code of tiered: the `tiered-bench` CLI's subcommands, and what the bench/ scripts import.

One module a subject, lowest first:

- `common` (errors, statistics, progress bars, the scripts' log lines and JSON records), `files` (where a
  folder lives, O_DIRECT, the page cache), `workspace` (a folder removed on every way out);
- `ring` (a file streamed through reusable request buffers), `io_types` (the io sweep's options and
  results), `baselines` (fio and aiofiles on the same file), `disk` (the io sweep), `mixed` (reads and
  writes at once, and the disk floor of bench/llama_step.py), `pcie` (host<->GPU copies);
- `workload` (the Llama-0.94B reference model and a tiny CPU model), `optim` (one offloaded AdamW step
  against the disk floor), `tour` (the default run), `tune` (the best IOConfig to a file);
- `plan` (the largest model a box can train, computed from the memory model of docs/capacity.md);
- `report` (tables, JSON, plot) and `commands` (the subcommands' flags; tiered/cli.py is the entry point).

Each `run_*` takes a typed options object and returns a result dataclass whose `asdict` form is the stable
`--json` output. The scripts in bench/ import from here (`from tiered.bench.mixed import measure_floor`).
"""
