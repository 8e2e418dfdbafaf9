#!/usr/bin/env bash
# Regenerates the measured tables of docs/methods.md (one seed, this machine's budget), its two
# "Measured results" sections: each table is printed (and kept under runs/) to be pasted there.
#   bash scripts/readme_tables.sh minilm     (PFAdapter table: "Measured results (MiniLM, fortunes, ...)")
#   bash scripts/readme_tables.sh fortunes   (FedPuReL long-tail table: "Measured results (MiniLM, long-tailed
#                                             fortunes, ...)"; one torch thread per run)
set -euo pipefail
cd "$(dirname "$0")/.."
FS=.venv/bin/fedsplice
part=${1:-all}
if [ "$part" = minilm ] || [ "$part" = all ]; then
for c in pfadapter fedavg-lora fedyogi-lora local; do
    $FS run configs/$c-minilm.toml --out runs/table/$c --overwrite --quiet
done
.venv/bin/python scripts/table.py runs/table/{pfadapter,fedavg-lora,fedyogi-lora,local} | tee runs/table/minilm.md
fi
if [ "$part" = fortunes ] || [ "$part" = all ]; then
LT="zeroshot promptfl cliplora fedsa-lora fedpurel-lora fedpurel-prompt fedclip fedpurel-adapter"
for c in $LT; do
    $FS run configs/$c-fortunes.toml --set runtime.threads=1 --out runs/table-lt/$c --overwrite --quiet
    .venv/bin/python scripts/table.py --longtail $(for d in $LT; do [ -f runs/table-lt/$d/results.json ] && echo runs/table-lt/$d; done) > runs/table-lt/fortunes.md
done
cat runs/table-lt/fortunes.md
fi
