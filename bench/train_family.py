"""Train the demo model family (see lm_coupling.demo.train); --bundle refreshes the assets.

python bench/train_family.py --out results/family            # CPU, default family
python bench/train_family.py --out results/family --bundle   # and bundle the smallest
python bench/train_family.py --device cuda                   # on a GPU
"""

import sys

from lm_coupling.demo.train import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
