"""The trainer's control client for a `vllm serve` server: vLLM's HTTP client, with the server's own error message
on a refusal and generation paused while a round is loaded.

Why: vLLM's `HTTPVLLMWeightSyncClient` raises a bare "500 Server Error" for any refusal, so the trainer never sees
what the engine said (the tensors a round got wrong, say). And a round loaded while requests are in flight gives
them part old, part new weights (one answer, two policies: GRPO's log-probs of asynchronous rollouts are then
wrong): `POST /pause?mode=wait` lets every request in flight finish on the old weights, holds new ones, and clears
the prefix cache; `/resume` after the load lets them run on the new.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import requests
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient


class EngineClient(HTTPVLLMWeightSyncClient):
    """`finish_weight_update` (where autotp-gloo's workers load a round) runs with the server's generation paused,
    unless `pause=False` (for a caller that drains the engine itself)."""

    def __init__(self, base_url: str, timeout: float = 300, *, pause: bool = True) -> None:
        super().__init__(base_url, timeout=timeout)
        self.pause = pause

    def _post(self, path: str, json: dict[str, Any] | None = None, params: dict[str, str] | None = None) -> None:
        response = requests.post(f"{self.base_url}/{path}", json=json, params=params, timeout=self.timeout)
        if not response.ok:
            raise RuntimeError(
                f"the vLLM server at {self.base_url} refused /{path} (HTTP {response.status_code}): "
                f"{_message(response)}"
            )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self.paused():
            super().finish_weight_update(weight_version)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Generation paused (in-flight requests finished first) for the body, resumed after it, also on failure."""
        if not self.pause:
            yield
            return
        self._post("pause", params={"mode": "wait"})
        try:
            yield
        finally:
            self._post("resume")


def _message(response: requests.Response) -> str:
    """The error vLLM's server put in its JSON body (`{"error": {"message": ...}}`), else the body's text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:4000]
