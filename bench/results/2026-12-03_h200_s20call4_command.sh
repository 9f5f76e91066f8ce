# race_diag.py's variants (before the fix; the script as it ran is bench/results/2026-12-03_h200_s20_race_diag.py without an argument)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; timeout -k 5 330 python3 bench/results/2026-12-03_h200_s20_race_diag.py > $OUT/race_diag.log 2>&1
