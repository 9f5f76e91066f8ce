#!/usr/bin/env bash
# Fortieth session, call 7 (as run).
LIMIT=100 bash bench/next_calls/gpu_all.sh 2 | tail -3; LIMIT=150 bash bench/next_calls/gpu_all.sh 3 | tail -3
