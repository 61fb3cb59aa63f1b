"""An installed, non-editable copy works on its own: `pip install --no-deps --target` of the source
tree, imported in a fresh interpreter from outside the repository, finds its package data
(official config, Metal sources), imports `mlx_v41.convert`, loads the tiny golden checkpoint
to the same logits as the source tree (both on the default device with its kernels: the same
computation, so equal on any backend) and builds and runs the demo checkpoint (its generator
ships in the package; tests/ does not).

pip builds in the source folder, so it builds from a copy to keep build/ and *.egg-info out of
the repository.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_v41

pytestmark = pytest.mark.slow  # pip installs a copy, then a fresh interpreter runs it

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "data" / "goldens" / "tiny" / "hf"
PROMPT = [0, 5, 9, 300, 17]
NOT_SHIPPED = shutil.ignore_patterns(
    ".git", "tests", "benchmarks", "examples", "build", "dist", "*.egg-info", "__pycache__",
    ".venv", ".pytest_cache")

# Runs in the installed copy: argv = target folder, checkpoint folder, repo metal/ folder,
# a folder for the demo checkpoint.
CHECK = r"""
import importlib.resources, json, sys
from pathlib import Path

import mlx.core as mx
import mlx_v41
import mlx_v41.convert
from mlx_v41.checkpoint.demo import ensure_demo_checkpoint
from mlx_v41.model.config import official_config_path

target, golden, repo_metal, demo = (Path(a).resolve() for a in sys.argv[1:5])
metal = importlib.resources.files("mlx_v41.metal")
model = mlx_v41.load_model(golden)
logits = model(mx.array([PROMPT]))
demo_model, demo_tokenizer = mlx_v41.load(ensure_demo_checkpoint(demo))
demo_logits = demo_model(mx.array([demo_tokenizer.encode("Hello")]))
print(json.dumps({
    "package": str(Path(mlx_v41.__file__).resolve()),
    "convert": str(Path(mlx_v41.convert.__file__).resolve()),
    "config": str(official_config_path().resolve()),
    "config_is_file": official_config_path().is_file(),
    "metal": str(Path(str(metal)).resolve()),
    "metal_files": sorted(p.name for p in metal.iterdir() if p.name.endswith((".metal", ".h"))),
    "repo_metal_files": sorted(p.name for p in repo_metal.iterdir()
                               if p.name.endswith((".metal", ".h"))),
    "logits": logits[0, -1].tolist(),
    "generator": str(Path(sys.modules["mlx_v41.checkpoint.random_checkpoint"].__file__).resolve()),
    "demo_finite": bool(mx.isfinite(demo_logits).all()),
}))
""".replace("PROMPT", repr(PROMPT))


def run(args, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)
    assert done.returncode == 0, f"{args[:4]} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not available in this interpreter")
    root = tmp_path_factory.mktemp("install")
    source, target = root / "src", root / "site"
    shutil.copytree(REPO, source, ignore=NOT_SHIPPED)
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "-q",
         "--disable-pip-version-check", "--target", str(target), str(source)])
    return target


def test_installed_copy_runs_outside_the_repo(installed, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(installed)
    done = run([sys.executable, "-c", CHECK, str(installed), str(GOLDEN), str(REPO / "metal"),
                str(tmp_path / "demo")], cwd=tmp_path, env=env)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    target = installed.resolve()
    for key in ("package", "convert", "config", "metal", "generator"):
        assert Path(report[key]).is_relative_to(target), (key, report[key])
    assert report["config_is_file"] and report["demo_finite"]
    assert report["metal_files"] == report["repo_metal_files"]

    reference = mlx_v41.load_model(GOLDEN)(mx.array([PROMPT]))[0, -1]
    assert np.array_equal(np.array(report["logits"], np.float32), np.array(reference))
