"""Write tests/fixtures/legacy_v0_adam.h5: an optimizer file as a training-format-0 writer made it.

Format 0 (before ``training_format_version`` existed) kept the optimizer metadata as JSON in
the root attribute ``optimizer``, its tensors under ``state/<param>/<key>`` and no RNG, step,
scheduler or data position. The file is deterministic: rerunning this script gives the same
tensors. Usage: python tools/make_legacy_fixture.py [OUTPUT]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from lean_store.sources import tensor_source
from lean_store.sources.optimizer import describe, param_names
from lean_store.writing import write_source

DEFAULT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "legacy_v0_adam.h5"


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.linspace(-1.0, 1.0, 12).reshape(4, 3)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    tensors: dict = {}
    meta = describe(opt, param_names(opt, model), "", tensors)
    write_source(tensor_source(tensors), out, kind="optimizer",
                 extra_root={"optimizer": json.dumps(meta, separators=(",", ":"))})
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
