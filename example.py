"""The seed's example: chat-template two prompts, generate, print. GPU if present, else CPU.

    python example.py              # the embedded default model (SmolLM2-135M-Instruct)
    python example.py MODEL_PATH   # any supported model directory or .gguf file
"""
import sys

from nanovllm import LLM, SamplingParams


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else None  # None: the embedded default model
    llm = LLM(path, enforce_eager=True, tensor_parallel_size=1)
    tokenizer = llm.get_tokenizer()

    sampling_params = SamplingParams(temperature=0.6, max_tokens=256)
    prompts = [
        "introduce yourself",
        "list all prime numbers within 100",
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for prompt in prompts
    ]
    outputs = llm.generate(prompts, sampling_params)

    for prompt, output in zip(prompts, outputs):
        print("\n")
        print(f"Prompt: {prompt!r}")
        print(f"Completion: {output['text']!r}")


if __name__ == "__main__":
    main()
