"""AOTInductor packages on this device, stage by stage: one Linear (torch's own API, then
``loka.aot_compile`` with and without the package's locking), then the evaluation set's
model in bf16 as its serving rows make it, each stage printed before it runs and faults
traced (``faulthandler``), so a crash names its stage.

    python bench/aot_smoke.py --out smoke.json [--model dcnv2] [--batch 4096]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def stage(log: list, name: str, fn):
    print(f"stage {name} ...", flush=True)
    t0 = time.perf_counter()
    try:
        out = fn()
        log.append({"stage": name, "ok": True, "s": round(time.perf_counter() - t0, 2)})
        return out
    except Exception as e:  # noqa: BLE001 - recorded, then stop
        log.append({"stage": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"})
        raise


def main(argv=None) -> int:
    faulthandler.enable()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dcnv2")
    p.add_argument("--batch", type=int, default=4096)
    args = p.parse_args(argv)
    import loka
    from loka.dispatch.aot import _export

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    log: list = []
    doc = {"device": dev, "torch": torch.__version__, "stages": log}

    def save():
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    folder = tempfile.mkdtemp()
    try:
        lin = nn.Linear(256, 128).to(dev, dtype).eval()
        x = (torch.randn(64, 256, device=dev, dtype=dtype),)
        with torch.no_grad():
            ep = stage(log, "linear export", lambda: _export(lin, x, False))
            pkg = stage(log, "linear compile", lambda: torch._inductor.aoti_compile_and_package(
                ep, package_path=os.path.join(folder, "plain.pt2")))
            raw = stage(log, "linear load (torch)", lambda: torch._inductor.aoti_load_package(pkg))
            stage(log, "linear call (torch)", lambda: raw(*x))
            served = stage(log, "linear loka.aot_compile",
                           lambda: loka.aot_compile(lin, x, os.path.join(folder, "lin.pt2")))
            stage(log, "linear AOTModel call", lambda: served(*x))
            # as the evaluation set's rows load it: without the package's locking
            single = stage(log, "linear loka.aot_compile, single_threaded",
                           lambda: loka.aot_compile(lin, x, os.path.join(folder, "lin1.pt2"),
                                                    single_threaded=True))
            stage(log, "linear AOTModel call, single_threaded", lambda: single(*x))
            save()
            import evalset
            model = evalset.EVAL_MODELS[args.model]("paper").to(dev).to(dtype).eval()
            batch = model.make_batch(args.batch, dev, dtype, seed=0)[0]
            served = stage(log, f"{args.model} loka.aot_compile", lambda: loka.aot_compile(
                model, batch, os.path.join(folder, "m.pt2"), single_threaded=True))
            doc["check"] = served.check
            stage(log, f"{args.model} AOTModel call", lambda: served(*batch))
            if dev == "cuda":
                torch.cuda.synchronize()
    finally:
        save()
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
