"""What `kimitui bench` measures: the engine in this process, or an OpenAI-compatible server.

A target owns the tokenizer that builds the prompts, hands out the matching client and cleans
up after itself. The engine (and torch) is imported only by the target that needs it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kimitui.bench.clients import InProcessClient, OpenAICompletionsClient, fetch_models


class InProcessTarget:
    """An `engine.AsyncLLM` loaded here; `close()` shuts it down."""

    def __init__(self, llm: Any, model_name: str, device: str = ""):
        if llm.tokenizer is None:
            llm.shutdown()
            raise ValueError(f"{model_name}: the checkpoint has no tokenizer to build prompts with")
        self.llm = llm
        self.model_name = model_name
        self.tokenizer = llm.tokenizer
        self.max_model_len: int | None = getattr(llm.engine, "max_model_len", None)
        # GPUs the engine runs on: none when its device is the CPU, else one per tensor-parallel rank
        engine_device = str(getattr(llm.engine, "device", "cpu"))
        args = getattr(llm.engine, "args", None)
        self.num_gpus = 0 if engine_device.startswith("cpu") else getattr(args, "tensor_parallel_size", 1)
        self.describe = f"{model_name} in-process" + (f" on {device}" if device else "")

    @classmethod
    def load(cls, engine_args: Any) -> "InProcessTarget":
        """Load the checkpoint `engine_args` names (the demo when `model` is None)."""
        from kimitui.engine import AsyncLLM

        llm = AsyncLLM(engine_args=engine_args)
        # vLLM's model_id is what --model said; the demo has no path worth showing, only a name.
        name = engine_args.model or getattr(llm.config, "name", None) or "kimitui-demo"
        return cls(llm, name, str(getattr(llm.engine, "device", "")))

    async def open(self, config: Any) -> InProcessClient:
        # Text round trip like vLLM: the same seed then gives this run and a --base-url run
        # against the same checkpoint identical prompts, token for token.
        return InProcessClient(
            self.llm,
            model=self.model_name,
            temperature=config.temperature,
            ignore_eos=config.ignore_eos,
            text_prompts=True,
        )

    def close(self) -> None:
        self.llm.shutdown()


class HttpTarget:
    """A server at `base_url`; `model` is the served model name (None: ask /v1/models)."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        tokenizer_dir: str | None = None,
        api_key: str | None = None,
        http_client: str = "auto",
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.tokenizer_dir = tokenizer_dir
        self.api_key = api_key
        self.http_client = http_client
        self.tokenizer: Any = None
        self.max_model_len: int | None = None
        self.describe = self.base_url
        if tokenizer_dir is not None:
            # Fail on a bad --tokenizer before touching the network.
            self.tokenizer = load_tokenizer(tokenizer_dir)

    async def open(self, config: Any) -> OpenAICompletionsClient:
        if self.model is None:
            try:
                self.model = (await fetch_models(self.base_url, self.api_key))[0]
            except RuntimeError as e:
                raise ConnectionError(str(e)) from e
        if self.tokenizer is None:
            self.tokenizer = self._default_tokenizer(self.model)
        client = OpenAICompletionsClient(
            self.base_url,
            self.model,
            api_key=self.api_key,
            temperature=config.temperature,
            ignore_eos=config.ignore_eos,
            http_client=self.http_client,
        )
        self.describe = f"{self.base_url} (model {self.model}, HTTP client: {client.http_client})"
        return client

    @staticmethod
    def _default_tokenizer(model: str) -> Any:
        # `vllm serve /path/to/ckpt` serves the model under its path: use that tokenizer.
        path = Path(model).expanduser()
        if path.is_dir() and ((path / "tokenizer.json").is_file() or (path / "tiktoken.model").is_file()):
            return load_tokenizer(str(path))
        from kimitui.engine.demo import demo_checkpoint

        if "demo" not in model:
            print(
                f"kimitui bench: building prompts with the demo tokenizer; pass --tokenizer DIR with "
                f"{model}'s checkpoint for prompts of exactly the requested length",
                file=sys.stderr,
            )
        return load_tokenizer(str(demo_checkpoint("demo-k3" if model == "demo-k3" else "demo")))

    def close(self) -> None:
        pass


def load_tokenizer(directory: str) -> Any:
    """The tokenizer of a checkpoint directory; ValueError (one line) when there is none."""
    from kimitui.engine.text.tokenizer import Tokenizer, TokenizerError

    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ValueError(f"tokenizer directory {path} does not exist")
    try:
        return Tokenizer.from_pretrained(path)
    except TokenizerError as e:
        raise ValueError(str(e)) from e
