/* models/precision.c: a model's precision (models/precision.h): the
 * setting, the 16-bit copy of the weights that products read, rounding an
 * activation, and the dynamic loss scaler with its multi-process hook.
 * The layers' 16-bit paths are models/layers.c (MLP, CNN) and
 * models/gpt_low.c (GPT); the kernels are core/'s. */
#include "models/model_impl.h"

#include <math.h>
#include <string.h>
#include <strings.h>

#include "models/builder.h"

tdm_status tdm_precision_parse(const char *s, tdm_precision *out)
{
    static const struct { const char *name; tdm_precision p; } names[] = {
        {"fp32", TDM_PRECISION_FP32}, {"float32", TDM_PRECISION_FP32},
        {"bf16", TDM_PRECISION_BF16}, {"bfloat16", TDM_PRECISION_BF16},
        {"fp16", TDM_PRECISION_FP16}, {"float16", TDM_PRECISION_FP16},
    };
    for (size_t i = 0; s && i < sizeof names / sizeof names[0]; i++)
        if (!strcasecmp(s, names[i].name)) {
            *out = names[i].p;
            return TDM_STATUS_OK;
        }
    return tdm_error_set(TDM_STATUS_INVALID_ARG, "precision '%s': expected fp32, bf16 or fp16",
                         s ? s : "(null)");
}

const char *tdm_precision_name(tdm_precision p)
{
    return p == TDM_PRECISION_BF16 ? "bf16" : p == TDM_PRECISION_FP16 ? "fp16" : "fp32";
}

tdm_dtype tdm_precision_dtype(tdm_precision p)
{
    return p == TDM_PRECISION_BF16   ? TDM_DTYPE_BFLOAT16
           : p == TDM_PRECISION_FP16 ? TDM_DTYPE_FLOAT16
                                     : TDM_DTYPE_FLOAT32;
}

tdm_status tdm_model_set_precision(tdm_model *m, tdm_precision p)
{
    TDM_REQUIRE(p == TDM_PRECISION_FP32 || p == TDM_PRECISION_BF16 || p == TDM_PRECISION_FP16,
                TDM_STATUS_INVALID_ARG, "unknown precision %d", (int)p);
    if (p == m->lev.prec) return TDM_STATUS_OK;
    if (tdm_model_spec_lever_op(&m->spec) >= 0) {
        char why[512];
        tdm_model_spec_lever_refusal(&m->spec, why, sizeof why);
        return tdm_error_set(TDM_STATUS_INVALID_ARG, "precision %s: %s (use --precision fp32)",
                             p == TDM_PRECISION_BF16 ? "bf16" : "fp16", why);
    }
    tdm_model_drop_activations(m);
    tdm_dev_free(m->dev, m->lev.wlow);
    m->lev.wlow = NULL;
    m->lev.prec = TDM_PRECISION_FP32;
    m->lev.adt = TDM_DTYPE_FLOAT32;
    if (p == TDM_PRECISION_FP32) return TDM_STATUS_OK;
    tdm_dtype t = tdm_precision_dtype(p);
    /* zeroed: the padding between tensors is never written by a cast */
    TDM_CHECK(tdm_dev_alloc_zero(m->dev, (size_t)m->param_elems * tdm_dtype_size(t), &m->lev.wlow));
    m->lev.prec = p;
    m->lev.adt = t;
    return TDM_STATUS_OK;
}

tdm_precision tdm_model_precision(const tdm_model *m) { return m->lev.prec; }

tdm_status tdm_model_cast_params(tdm_model *m, int first, int last)
{
    if (!tdm_model_low(m)) return TDM_STATUS_OK;
    for (int i = first; i <= last; i++) {
        const tdm_tensor_info *t = &m->params_info[i];
        if (t->ndim < 2) continue;   /* biases, norms: read in float32 */
        TDM_CHECK(tdm_dev_convert(m->dev, tdm_model_wlow(m, i), m->lev.adt, tdm_model_pdata(m, i),
                                  TDM_DTYPE_FLOAT32, t->n_elem));
    }
    return TDM_STATUS_OK;
}

tdm_status tdm_model_round(tdm_model *m, float *x, void *dst, int64_t n)
{
    TDM_CHECK(tdm_dev_convert(m->dev, dst, m->lev.adt, x, TDM_DTYPE_FLOAT32, n));
    return tdm_dev_convert(m->dev, x, TDM_DTYPE_FLOAT32, dst, m->lev.adt, n);
}

/* ---- the loss scaler ---- */

void tdm_grad_scaler_opts_default(tdm_grad_scaler_opts *o)
{
    /* torch.cuda.amp.GradScaler's defaults */
    o->init_scale = 65536.0f;
    o->growth_factor = 2.0f;
    o->backoff_factor = 0.5f;
    o->growth_interval = 2000;
}

tdm_status tdm_grad_scaler_init(tdm_grad_scaler *s, const tdm_grad_scaler_opts *o)
{
    tdm_grad_scaler_opts def;
    if (!o) {
        tdm_grad_scaler_opts_default(&def);
        o = &def;
    }
    TDM_REQUIRE(isfinite(o->init_scale) && o->init_scale > 0.0f, TDM_STATUS_INVALID_ARG,
                "loss scaler: initial scale %g must be finite and > 0", (double)o->init_scale);
    TDM_REQUIRE(isfinite(o->growth_factor) && o->growth_factor > 1.0f, TDM_STATUS_INVALID_ARG,
                "loss scaler: growth factor %g must be > 1", (double)o->growth_factor);
    TDM_REQUIRE(o->backoff_factor > 0.0f && o->backoff_factor < 1.0f, TDM_STATUS_INVALID_ARG,
                "loss scaler: backoff factor %g must be in (0, 1)", (double)o->backoff_factor);
    TDM_REQUIRE(o->growth_interval >= 1, TDM_STATUS_INVALID_ARG,
                "loss scaler: growth interval %lld must be >= 1", (long long)o->growth_interval);
    memset(s, 0, sizeof *s);
    s->opts = *o;
    s->scale = o->init_scale;
    return TDM_STATUS_OK;
}

float tdm_grad_scaler_scale(const tdm_grad_scaler *s) { return s->scale; }

tdm_status tdm_grad_scaler_unscale(tdm_grad_scaler *s, tdm_device *dev, float *grads,
                                   int64_t n_elem, int *found_inf)
{
    float *flag = NULL, host = 0.0f;
    /* PyTorch: the reciprocal in double, rounded to float (exact for the
     * powers of two the defaults produce) */
    float inv = (float)(1.0 / (double)s->scale);
    TDM_CHECK(tdm_dev_scratch(dev, sizeof(float), (void **)&flag));
    TDM_CHECK(tdm_dev_memset_zero(dev, flag, sizeof(float)));
    TDM_CHECK(tdm_dev_unscale_check(dev, grads, n_elem, inv, flag));
    TDM_CHECK(tdm_dev_copy_to_host(dev, &host, flag, sizeof(float)));
    *found_inf = host != 0.0f;
    return TDM_STATUS_OK;
}

tdm_status tdm_grad_scaler_sync_found_inf(tdm_comm *comm, tdm_device *dev, int *found_inf)
{
    float *flag = NULL, host = *found_inf ? 1.0f : 0.0f;
    TDM_CHECK(tdm_dev_scratch(dev, sizeof(float), (void **)&flag));
    TDM_CHECK(tdm_dev_copy_from_host(dev, flag, &host, sizeof(float)));
    tdm_comm_set_label(comm, "grad scaler found inf");
    TDM_CHECK(tdm_comm_all_reduce(comm, flag, flag, 1, TDM_DTYPE_FLOAT32, TDM_REDOP_MAX));
    TDM_CHECK(tdm_dev_copy_to_host(dev, &host, flag, sizeof(float)));
    *found_inf = host != 0.0f;
    return TDM_STATUS_OK;
}

void tdm_grad_scaler_update(tdm_grad_scaler *s, int found_inf)
{
    /* torch.cuda.amp.GradScaler.update (_amp_update_scale_) */
    if (found_inf) {
        s->scale *= s->opts.backoff_factor;
        s->growth_tracker = 0;
        s->skipped++;
        return;
    }
    if (++s->growth_tracker == s->opts.growth_interval) {
        /* a scale that would overflow stays (PyTorch's isfinite guard) */
        float grown = s->scale * s->opts.growth_factor;
        if (isfinite(grown)) s->scale = grown;
        s->growth_tracker = 0;
    }
}
