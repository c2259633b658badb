/* core/geom.h: the geometry of a 2-D convolution or pooling over a CNHW
 * tensor, shared by the device interface (core/device.h) and the kernels
 * both backends run (core/kernels.h), so that it is one struct passed as
 * is from a layer to a kernel. Plain C, also compiled by nvcc. */
#ifndef TDM_CORE_GEOM_H
#define TDM_CORE_GEOM_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_conv_geom {
    int n, c, h, w;         /* input: (C, N, H, W) */
    int kh, kw, stride, pad;
    int oh, ow;             /* output spatial size */
    /* im2col / col2im only: the batch stride of x and dx, in images. The
     * geometry may cover n images out of a batch of ns (a chunk: x points
     * at its first image, and channel ci's images start ns * h * w floats
     * apart); 0 means ns = n (the whole tensor). col is always the
     * chunk's own (C*KH*KW, n*OH*OW). */
    int ns;
} tdm_conv_geom;

#ifdef __cplusplus
}
#endif

#endif
