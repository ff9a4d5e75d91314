"""Packaging: the Docker image's file set builds the wheel, without setuptools warnings.

The CI machines have no Docker engine, so the image itself is never built here. What can break it
without a GPU is the file set: ``pyproject.toml`` naming a directory the Dockerfile does not copy.
The test below copies exactly what the Dockerfile's ``COPY`` lines name, with Docker's semantics (a
directory's *contents* land in the destination; links inside it stay links), into an empty
directory and builds the wheel where the Dockerfile's ``pip install`` does.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(instruction, arguments) per Dockerfile instruction, continuation lines joined."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def copy_like_docker(sources: list[str], dest: str, context: Path, root: Path) -> None:
    """``COPY sources dest`` from ``context`` into the image tree ``root``."""
    target = root / dest.lstrip("/")
    into_dir = dest.endswith("/") or len(sources) > 1
    for src in sources:
        path = context / src
        if not path.exists():
            raise FileNotFoundError(f"COPY source {src} does not exist in the build context")
        if path.is_dir():  # Docker copies the directory's contents, not the directory itself
            shutil.copytree(path, target, symlinks=True, ignore=IGNORED, dirs_exist_ok=True)
        else:
            to = target / path.name if into_dir else target
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, to)


def image_tree(root: Path) -> Path:
    """Apply the Dockerfile's COPY lines into ``root``; return the directory ``pip install`` builds."""
    install_dir = None
    for word, args in dockerfile_instructions(DOCKERFILE.read_text()):
        if word == "COPY":
            parts = [p for p in shlex.split(args) if not p.startswith("--")]
            copy_like_docker(parts[:-1], parts[-1], REPO, root)
        elif word == "RUN" and "pip install" in args:
            install_dir = next(p for p in shlex.split(args) if p.startswith("/"))
    assert install_dir is not None, "the Dockerfile has no `RUN pip install /path`"
    return root / install_dir.lstrip("/")


def test_dockerfile_instructions_parse():
    ins = dockerfile_instructions("FROM x\n# c\nCOPY a b \\\n  /d/\nRUN pip install /d\n")
    assert ins == [("FROM", "x"), ("COPY", "a b    /d/"), ("RUN", "pip install /d")]


def test_copy_like_docker_semantics(tmp_path):
    ctx, root = tmp_path / "ctx", tmp_path / "root"
    (ctx / "pkg" / "sub").mkdir(parents=True)
    (ctx / "pkg" / "sub" / "m.py").write_text("")
    (ctx / "a.txt").write_text("a")
    (ctx / "b.txt").write_text("b")
    (ctx / "pkg" / "link").symlink_to("../a.txt")
    copy_like_docker(["a.txt", "b.txt"], "/opt/x/", ctx, root)
    copy_like_docker(["pkg"], "/opt/x/pkg", ctx, root)
    assert (root / "opt/x/a.txt").read_text() == "a" and (root / "opt/x/b.txt").is_file()
    assert (root / "opt/x/pkg/sub/m.py").is_file()
    assert (root / "opt/x/pkg/link").is_symlink()
    with pytest.raises(FileNotFoundError, match="nope"):
        copy_like_docker(["nope"], "/opt/x/", ctx, root)


def _build_wheel(src: Path, out: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "--disable-pip-version-check", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"pip wheel failed on the Dockerfile's file set:\n{log[-4000:]}"
    return log


@pytest.fixture(scope="module")
def image_wheel(tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("image")
    log = _build_wheel(image_tree(tmp / "root"), tmp / "dist")
    (wheel,) = (tmp / "dist").glob("sfi_vllm-*.whl")
    return wheel, log


def test_wheel_builds_from_the_dockerfiles_copy_set(image_wheel):
    wheel, _ = image_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    for preset in ("balanced", "speed", "paper"):
        assert f"sfi_vllm/presets/{preset}.yaml" in names
    assert "sfi_vllm/kernels/fast_decode.py" in names
    assert not any(n.startswith("sfi_vllm_kernels/") for n in names)  # one package
    assert "sfi_vllm/plugin.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "sfi = sfi_vllm.plugin:register" in text and "sfi-vllm = sfi_vllm.tools.cli:main" in text


def test_wheel_holds_the_tooling_and_the_old_paths(image_wheel):
    wheel, _ = image_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("sfi_vllm/moved_modules.py", "sfi_vllm/tools/__init__.py", "sfi_vllm/tools/cli.py",
              "sfi_vllm/tools/quality/tasks.py", "sfi_vllm/kernels/fast_decode.py"):
        assert f in names, f


def test_wheel_build_has_no_setuptools_warning(image_wheel):
    _, log = image_wheel
    for marker in ("Warning:", "would be ignored", "!!"):
        assert marker not in log, f"setuptools warned ({marker!r}):\n{log[-4000:]}"


def test_the_checkout_does_not_shadow_a_kernels_package(tmp_path):
    """``kernels`` is also the import name of a PyPI package (Hugging Face's, which transformers
    imports when installed). From the repository root (``python -m ...``, pytest) the checkout is
    first on ``sys.path``; the top-level ``kernels/`` folder therefore has no ``__init__.py``, so
    an installed ``kernels`` package wins over it, while ``sfi_vllm.kernels`` still resolves to it."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("ORIGIN = 'third-party'\n")
    code = ("import importlib.util, kernels\n"
            "print(getattr(kernels, 'ORIGIN', None))\n"
            "print(importlib.util.find_spec('sfi_vllm.kernels.top_k_pages').origin)\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    origin, spec = out.stdout.strip().splitlines()[-2:]
    assert origin == "third-party", "the checkout's kernels/ shadows an installed kernels package"
    assert Path(spec).resolve() == (REPO / "kernels" / "top_k_pages.py").resolve()


def test_readme_config_table_is_current():
    from sfi_vllm.tools.config_table import markdown_table, readme_table

    readme = (REPO / "README.md").read_text()
    assert readme_table(readme) == markdown_table(), \
        "the README's configuration table is stale: run `python -m sfi_vllm.tools.config_table README.md`"


def test_readme_commands_and_house_rules():
    """The README's two commands are the ones .ci/run runs; the README is a manual (no dates,
    commit ids or paths outside the clone)."""
    import re

    readme = (REPO / "README.md").read_text()
    assert "bash scripts/setup_cpu.sh && .venv/bin/sfi-vllm demo" in readme
    assert ".venv/bin/python -m pytest -q -ra tests" in readme
    assert ".venv/bin/python -m pytest -q -ra tests" in (REPO / ".ci" / "run").read_text()
    for doc in ("README.md", "benchmarks/README.md", *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))):
        text = (REPO / doc).read_text()
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{doc} has a date"
        assert "../shared" not in text and not re.search(r"(?i)\bsession\b", text), doc
        assert not re.search(r"\bcommit [0-9a-f]{7}\b", text), f"{doc} names a commit"


def test_the_runtime_never_imports_the_tooling():
    """Every module of the runtime (sfi_vllm outside sfi_vllm.tools) imports without pulling in
    sfi_vllm.tools: the evaluation, demo and batch tooling stays out of a serving process."""
    root = Path(__file__).resolve().parents[1] / "sfi_vllm"
    names = sorted(
        "sfi_vllm." + ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for p in root.rglob("*.py") if "tools" not in p.relative_to(root).parts)
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name.removesuffix('.__init__'))\n"
            "print(sorted(k for k in sys.modules if k.startswith('sfi_vllm.tools')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=root.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert len(names) > 20  # the walk found the runtime


def test_old_tooling_import_paths_still_work():
    """Code written against the tooling's old paths (``sfi_vllm.model_prep``, ``python -m
    sfi_vllm.cli``) gets the moved module itself, with a DeprecationWarning."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from sfi_vllm.model_prep import prepare_model
        import sfi_vllm.quality.tasks as old_tasks
    import sfi_vllm.tools.model_prep as model_prep
    import sfi_vllm.tools.quality.tasks as tasks

    assert prepare_model is model_prep.prepare_model and old_tasks is tasks
    import importlib
    import importlib.util

    assert model_prep.__spec__.name == "sfi_vllm.tools.model_prep"  # its own spec, not the alias's
    assert type(importlib.util.find_spec("sfi_vllm.tools.model_prep").loader).__name__ == "SourceFileLoader"
    assert importlib.reload(model_prep).__name__ == "sfi_vllm.tools.model_prep"
    assert any("moved to sfi_vllm.tools.model_prep" in str(w.message) for w in caught)
    out = subprocess.run([sys.executable, "-m", "sfi_vllm.cli", "--help"], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and "prepare-model" in out.stdout, out.stderr[-2000:]


def test_relative_links_in_the_docs_resolve():
    """Every relative link of the README, benchmarks/README.md and docs/ names a file of the clone."""
    import re

    docs = [REPO / "README.md", REPO / "benchmarks" / "README.md", *(REPO / "docs").glob("*.md")]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert not broken, broken
