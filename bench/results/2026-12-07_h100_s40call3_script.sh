#!/usr/bin/env bash
# Fortieth session, call 3 (as run).
LIMIT=540 bash bench/next_calls/gpu_all.sh 1 | tail -40
