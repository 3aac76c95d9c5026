"""The start of every workflow rule's shell command: `python -m pipeline.launch` with its flags.

Built here, where the launcher's command line is defined, so a rule file only says what kind of
job it runs. Torch-free: the Snakefile calls it when it loads.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from pipeline.tracker import env_for


def shell_prefix(tracker: Mapping | None, *, gpus: int | str = 0, train: Mapping | None = None) -> str:
    """`[export PIPELINE_TRACKER_...; ]exec python -m pipeline.launch --log {log} --gpus G [--train ...] -- `.

    `pipeline.launch` sends the command's output to the rule's log and, when it fails, the reason to
    the terminal; it hands the job GPUs of its own (`gpus`: 0, a count or "all"), and with `train`
    (the workflow config's `train` section: nodes, nproc, the rendezvous timeout and port, the socket
    interface) runs a training stage as one process, under torchrun, or as one torchrun per node. The tracker section (`tracker`) is an environment, not a
    param, so that turning tracking on or off reruns no job. Braces are doubled: Snakemake formats
    the shell command, and fills in `{log}`.
    """
    extra = ""
    if train is not None:
        extra = f" --train --nodes {train['nodes']} --nproc {train['nproc']}"
        extra += f" --rdzv-timeout {train['rdzv_timeout_s']}" if train.get("rdzv_timeout_s") else ""
        extra += f" --rdzv-port {train['rdzv_port']}" if train.get("rdzv_port") else ""
        extra += f" --socket-ifname {train['socket_ifname']}" if train.get("socket_ifname") else ""
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env_for(dict(tracker or {})).items())
    return exports.replace("{", "{{").replace("}", "}}") + f"exec python -m pipeline.launch --log {{log}} --gpus {gpus}{extra} -- "
