"""The bearer-token admin routes: `POST /admin/update_weights`, `/admin/pause`, `/admin/resume`.

`Admin` checks the token (`auth_error`, which the app's gate calls before any body is read), makes a published weight
version live by handing it to the receiver of the mode that published it (primerl.transport.weight_transfer), and
pauses or resumes the engine. A weight change, a pause and a resume never overlap (one lock). A snapshot that cannot
be loaded is a 400 naming why, and the old weights keep serving.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from primerl.config.inference import InferenceConfig
from primerl.inference.engines.base import Engine
from primerl.inference.protocol import AdminState, APIError, UpdateWeightsRequest, printable
from primerl.transport.weight_transfer.base import LoadRefused, LoadState
from primerl.transport.weight_transfer.factory import build_receivers

log = logging.getLogger("primerl.inference")


class Admin:
    """The admin routes over one engine, and the server's weight receivers."""

    def __init__(self, engine: Engine, cfg: InferenceConfig) -> None:
        if cfg.admin_token is None:
            raise ValueError(
                "InferenceConfig.admin_token must be set before the app is built (see resolve_admin_token)"
            )
        self.engine = engine
        self.token = cfg.admin_token.get_secret_value()
        self.paused = False
        self.weight_state = LoadState()  # weight changes, pause and resume take its lock: one at a time
        self.receivers = build_receivers(cfg.weight_transfer, engine, cfg.weight_broadcast, self.weight_state)

    def auth_error(self, authorization: str) -> APIError | None:
        """The 401 for an `Authorization` header that does not carry the admin token, else None."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.token.encode()):
            return None
        return APIError(
            401,
            "admin routes need 'Authorization: Bearer <admin token>'",
            type="authentication_error",
            code="invalid_admin_token",
        )

    async def update_weights(self, req: UpdateWeightsRequest) -> AdminState:
        """Make the version at `req.path` live through the receiver of the mode that published it."""
        try:
            await self.receivers.load(Path(req.path), req.step, printable(req.path))
        except LoadRefused as e:
            raise APIError(400, e.message, param="path", code=e.code) from None
        return self.state()

    async def set_paused(self, paused: bool) -> AdminState:
        async with self.weight_state.lock:
            await (self.engine.pause() if paused else self.engine.resume())
            self.paused = paused
            log.info("engine %s", "paused" if paused else "resumed")
        return self.state()

    def state(self) -> AdminState:
        return AdminState(policy_version=self.engine.policy_version, paused=self.paused)
