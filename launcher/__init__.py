"""The launch: tritonserver from the nvidia-pytriton wheel and the OpenAI front door, supervised.

Standard library only, so that any Python 3 can import it. Rooms: ``paths`` (checkout, venv, binary),
``commands`` (argv and environment), ``readiness`` (ports and health probes), ``processes`` (start, stop,
``running_server``), ``supervisor`` (restarts), ``serve`` (the ``llm-serve`` CLI), ``replicas``
(``llm-serve-replicas``: N launches behind HAProxy), ``prepare_model`` and ``hash_requirements`` (set-up).
The names most callers need are here::

    from launcher import running_server
    with running_server("model_repository") as srv:
        srv.grpc_url
"""

from launcher.commands import ADMIN_HEADER, frontend_command, server_command
from launcher.paths import (
    BACKEND_DIR,
    DEFAULT_HOST,
    DEFAULT_MODEL_REPOSITORY,
    MODEL_NAME,
    REPO_ROOT,
    VENV,
    site_packages,
    url_host,
)
from launcher.processes import RunningServer, running_server, start_frontend, start_server, stop_server
from launcher.readiness import (
    ServerError,
    free_port,
    is_ready,
    log_tail,
    url_ok,
    wait_until_frontend_ready,
    wait_until_ready,
    wait_until_url_ok,
)

__all__ = [
    "ADMIN_HEADER",
    "BACKEND_DIR",
    "DEFAULT_HOST",
    "DEFAULT_MODEL_REPOSITORY",
    "MODEL_NAME",
    "REPO_ROOT",
    "VENV",
    "RunningServer",
    "ServerError",
    "free_port",
    "frontend_command",
    "is_ready",
    "log_tail",
    "running_server",
    "server_command",
    "site_packages",
    "start_frontend",
    "start_server",
    "stop_server",
    "url_host",
    "url_ok",
    "wait_until_frontend_ready",
    "wait_until_ready",
    "wait_until_url_ok",
]
