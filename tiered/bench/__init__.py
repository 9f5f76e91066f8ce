"""The measuring code behind `tiered-bench` (tiered/cli.py is only its argparse layer).

One module a subject: `disk` (io_engine bandwidth sweep), `fio` and `aiofiles` comparisons inside it,
`pcie` (host<->GPU copies), `optim` (one offloaded AdamW step against the disk floor), `tour` (the
default run), `report` (tables, JSON, plot). Each `run_*` takes a typed options object and returns a
result dataclass whose `asdict` form is the stable `--json` output.
"""
