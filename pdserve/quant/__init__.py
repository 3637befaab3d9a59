"""Weight-only quantization: INT8 per-output-channel and INT4 group-wise, by RTN or GPTQ.

Pieces, in the order data flows through them:

    spec        QuantSpec (bits, group size, sym, desc_act) and the one error type, QuantError
    quantizer   per-group scale/zero choice and round-to-nearest codes (RTN)
    gptq        the GPTQ solver: Hessian-weighted, column by column, error propagated in blocks
    packing     GPTQ's int32 packing of codes (rows of qweight, columns of qzeros)
    gptq_format QuantizedWeight (qweight, qzeros, scales, g_idx) <-> codes; checkpoint read/write
    linear      the "linear" objects the runtime model calls: dense, quantized (dequantize on the
                fly), concatenated
    calibration builtin/user calibration text -> token chunks
    layerwise   the layer-by-layer driver that quantizes a whole model (`quantize_model`)

The on-disk layout is AutoGPTQ's classic "gptq" checkpoint format (docs/quantization.md), so one
loader serves both our `pdserve quantize` output and checkpoints quantized elsewhere.
"""
