"""The newcomer's CI path on the real model, timed: `tokq init` in a new git repository, a commit, then the GitHub
Action's `run:` steps (action.yml, as tests/test_ci_action.py runs them) in a clone at one absolute path, and again
in a clone at another with the first run's cache paths restored (the runner's tokq home and the variants folder).

    python benchmarks/ci_transcript.py [--work /tmp/tokq-ci-transcript]

Run it with the Python of the tokq install to use (a fresh clone's .venv/bin/python for the closing transcript):
`python -m pip` inside the steps is a no-op (tokq is already installed there), every other step runs as written.
The first run starts from an empty tokq home, so it pulls the model from the zoo, builds the default document set
and the starter's int4 variant; the second must reuse all three. Writes benchmarks/results/ci-transcript-<cpu>.json
(each run's seconds, exit code, the verdict lines, whether the variant was reused) and prints each run's log tail.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from vs_llamacpp import cpu_facts, cpu_tag  # noqa: E402

from tests.test_ci_action import action, run_steps, shims  # noqa: E402

GIT = ["git", "-c", "user.name=ci-transcript", "-c", "user.email=ci@example.invalid"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tokq-ci-transcript"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    project = work / "project"
    project.mkdir(parents=True)
    home = work / "runner-home"  # the runner's tokq home: empty before run 1, restored (kept) for run 2
    env = {**os.environ, "PATH": f"{shims(work / 'shims')}{os.pathsep}{os.environ['PATH']}", "TOKQ_HOME": str(home)}
    tokq = [sys.executable, "-m", "tokq"]
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run([*tokq, "init"], cwd=project, env=env, check=True)
    (project / ".gitignore").write_text("tokq_out/\ntokq_gate/\n")
    subprocess.run([*GIT, "-C", str(project), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(project), "commit", "-q", "-m", "gate the int4 build with tokq"], check=True)
    inputs = {name: str(spec.get("default", "")) for name, spec in action()["inputs"].items()}
    record: dict = {"benchmark": "ci_transcript", "cpu": cpu_tag(cpu_facts()), "cpus": os.cpu_count(),
                    "load_average_start": os.getloadavg(), "runs": []}
    for n in (1, 2):
        workspace = work / f"runner-{n}" / "project"
        subprocess.run(["git", "clone", "-q", str(project), str(workspace)], check=True)
        if n == 2:  # the actions/cache step restores what run 1 saved (the tokq home stays where it was)
            shutil.copytree(work / "runner-1" / "project" / inputs["variants-dir"], workspace / inputs["variants-dir"],
                            symlinks=True)
        summary = work / f"summary-{n}.md"
        outputs, log, seconds = run_steps(workspace, {**env, "GITHUB_STEP_SUMMARY": str(summary)}, inputs,
                                          timeout=3600)
        flat = log.replace("\n", " ")
        verdict = [line for line in log.splitlines() if line.startswith(("int4:", "tokq gate:")) or "tokq gate: " in line]
        record["runs"].append({"run": n, "workspace": f"runner-{n}/project", "seconds": round(seconds, 1),
                               "exit_code": outputs.get("gate.exit-code"), "verdict_lines": verdict[:12],
                               "variant_reused": "follows its recipe" in flat,
                               "summary_written": summary.is_file() and "tokq gate" in summary.read_text()})
        print(f"=== run {n} in {workspace}: exit {outputs.get('gate.exit-code')} in {seconds:.0f} s")
        print("\n".join(log.splitlines()[-40:]))
    record["load_average_end"] = os.getloadavg()
    out = args.out or ROOT / "benchmarks" / "results" / f"ci-transcript-{record['cpu']}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
