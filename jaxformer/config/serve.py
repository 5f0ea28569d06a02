"""The HTTP server's section (`jaxformer serve`): where it listens, the key it asks for, the model's name."""

from __future__ import annotations

import dataclasses
import re

from jaxformer.config.base import check_field_types, require


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """`jaxformer serve`: an OpenAI-compatible server of one workdir's model (jaxformer.serve).

    Not a part of the run's Config: a training run never reads it.

    Attributes:
        host: the address to listen on ("127.0.0.1": this machine only).
        port: the TCP port.
        api_key: the key clients must send as `Authorization: Bearer KEY`, or None (none asked).
        model_name: the model's id in /v1/models and in requests, or None (the workdir's directory name).
        lora_updates: LoRA adapters may be loaded and unloaded while it serves (vLLM's /v1/load_lora_adapter
            and /v1/unload_lora_adapter, which vLLM opens with VLLM_ALLOW_RUNTIME_LORA_UPDATING).
        responses_store: how many Responses API answers it keeps in memory, the most recent, for
            `previous_response_id` and `GET /v1/responses/{id}` (0: none).
    """

    host: str = "127.0.0.1"  # this machine only; "0.0.0.0" opens it to the network (give it an api_key then)
    port: int = 8000
    api_key: str | None = None  # clients send `Authorization: Bearer KEY`; None: no key asked
    model_name: str | None = None  # the id in /v1/models and requests' "model"; None: the workdir's directory name
    lora_updates: bool = False  # the routes that load and unload LoRA adapters are open (behind the api_key)
    responses_store: int = 1000  # the Responses API's answers kept (the most recent) for previous_response_id

    def __post_init__(self):
        p = "serve"
        check_field_types(self, p)
        require(bool(self.host.strip()), f"{p}.host", "an address to listen on, e.g. 127.0.0.1; got ''")
        require(1 <= self.port <= 65535, f"{p}.port", f"a TCP port in [1, 65535], got {self.port}")
        require(self.responses_store >= 0, f"{p}.responses_store", f"a count >= 0, got {self.responses_store}")
        if self.api_key is not None:
            require(
                bool(self.api_key) and not re.search(r"\s", self.api_key),
                f"{p}.api_key",
                "a non-empty key without spaces (clients send it in a header), or None for no key",
            )
        if self.model_name is not None:
            require(
                bool(self.model_name) and not re.search(r"\s", self.model_name),
                f"{p}.model_name",
                f'a non-empty name without spaces (clients send it as "model"), got {self.model_name!r}',
            )

    def replace(self, **changes) -> ServeConfig:
        """The config with `changes` applied, validated again.

        Args:
            **changes (object): field=value pairs.

        Returns:
            A new ServeConfig.

        Raises:
            ConfigError: a changed field's value is invalid.
        """
        return dataclasses.replace(self, **changes)
