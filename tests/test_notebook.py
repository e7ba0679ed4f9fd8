"""experiments/quickstart.ipynb runs top to bottom (its own checks included: eval AUC,
sparse row updates, the runner in a temporary directory) in a fresh kernel that uses
this interpreter and this checkout of sparsejax."""

import os
import re
import sys
from pathlib import Path

import pytest
from _cli import one_device_env
from _data import CRITEO_SAMPLE, data_dir

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "experiments" / "quickstart.ipynb"
MIN_AUC = 0.70  # the notebook asserts the same; one epoch reaches ~0.73


def _kernel_env(data: Path) -> dict[str, str]:
    # conftest.py fakes 8 CPU devices for mesh tests; the notebook runs on one, as a
    # user's would
    env = one_device_env()
    env["SPARSEJAX_DATA_DIR"] = str(data)  # where the notebook finds the sample
    # The kernel imports the sparsejax under test, installed or not (its cwd is experiments/).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _outputs_text(cell) -> str:
    return "".join(
        o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream"
    )


def test_quickstart_notebook_runs(tmp_path):
    data = data_dir()
    if data is None:
        pytest.skip(
            f"the Criteo sample {CRITEO_SAMPLE} is not under $SPARSEJAX_DATA_DIR "
            f"(nor in shared/data beside the repository)"
        )
    try:
        import matplotlib  # noqa: F401 - the notebook plots
        import nbclient
        import nbformat
        from ipykernel import kernelspec
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import KernelManager
    except ImportError as e:
        pytest.fail(
            f"running the notebook needs nbclient, nbformat, ipykernel and matplotlib ({e})"
        )

    # A kernelspec of exactly this interpreter, so no "python3" spec installed elsewhere
    # (user or system Jupyter dirs) can start a different environment.
    kernels = tmp_path / "kernels"
    kernelspec.write_kernel_spec(str(kernels / "sparsejax-test"))
    km = KernelManager(
        kernel_name="sparsejax-test",
        kernel_spec_manager=KernelSpecManager(
            kernel_dirs=[str(kernels)], ensure_native_kernel=False
        ),
    )
    assert km.kernel_spec.argv[0] == sys.executable

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook with its outputs cleared"
    )
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=300,
        allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    before = set(NOTEBOOK.parent.iterdir())
    # Raises CellExecutionError naming a failing cell; cleanup_kc: shut the kernel down and
    # close its channels although the client does not own `km`.
    client.execute(env=_kernel_env(data), cleanup_kc=True)

    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    text = "\n".join(_outputs_text(c) for c in nb.cells if c.cell_type == "code")
    auc = re.search(r"final eval: AUC ([0-9.]+)", text)
    assert auc, "the notebook printed no final eval AUC"
    assert float(auc.group(1)) > MIN_AUC, text
    runner_auc = re.search(r"runner: eval AUC ([0-9.]+)", text)
    assert runner_auc and float(runner_auc.group(1)) > 0.65, text
    assert set(NOTEBOOK.parent.iterdir()) == before, "the notebook left files in experiments/"
