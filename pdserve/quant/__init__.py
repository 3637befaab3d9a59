"""Quantization: INT8 per-output-channel and INT4 group-wise weights (RTN, GPTQ, QAT), INT8
activations (dynamic per row, or static from calibration: W8A8), and mixed per-module formats.

Pieces, in the order data flows through them:

    spec        QuantSpec (bits, group size, sym, desc_act) and the one error type, QuantError
    quantizer   per-group scale/zero choice and round-to-nearest codes (RTN)
    gptq        the GPTQ solver: Hessian-weighted, column by column, error propagated in blocks
    packing     GPTQ's int32 packing of codes (rows of qweight, columns of qzeros)
    gptq_format QuantizedWeight (qweight, qzeros, scales, g_idx) <-> codes; checkpoint read/write
    linear      the "linear" objects the runtime model calls: dense, quantized (dequantize on the
                fly), concatenated
    calibration builtin/user calibration text -> token chunks
    layerwise   the layer-by-layer driver that quantizes a whole model (`quantize_model`,
                `quantize_w8a8`; per-module rules for mixed formats)
    int8_act    W8A8: INT8 weights with activations quantized per row or with calibrated scales,
                multiplied by torch._int_mm (docs/quantization-activations.md)
    int4_cpu    a GGUF's own Q4_0/Q4_1/Q4_K codes packed for torch's CPU int4 kernel
    gguf_packed the GGUF's block codes parsed (Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K); 8-bit codes served as two
                4-bit planes of the same kernel (`--weight-format packed`)
    qat         quantization-aware training with distillation (docs/qat.md)
    accuracy    KL / top-1 / perplexity / task score of a format against fp32 (pdserve quant-eval)

The on-disk layout is AutoGPTQ's classic "gptq" checkpoint format (docs/quantization.md), so one
loader serves both our `pdserve quantize` output and checkpoints quantized elsewhere.
"""
