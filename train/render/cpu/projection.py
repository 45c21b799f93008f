"""Projection of 3D Gaussians into one camera on the CPU: fused numba kernels with a hand-derived
backward, behind a torch autograd Function (as gsplat's CUDA projection and SH kernels are).

gsplat's EWA formulas and culling (`fully_fused_projection` with opacities): camera-space covariance
R (Rq S)(Rq S)^T R^T, the perspective Jacobian at the mean with x/z and y/z clamped to 1.3 half
fields of view, eps2d on the 2D covariance, opacity-aware radii, and rows dropped when outside the
near/far planes, degenerate, unable to reach alpha 1/255 anywhere, or with a radius box off the
image. Colour: SH of the direction from the camera centre + 0.5, clamped at 0. Math in float64,
fused and reassociated but never assuming finite values (`compiled.FINITE_FASTMATH`).
"""
from __future__ import annotations

import math
import mmap

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from train.camera import Camera
from train.render.cpu.compiled import FINITE_FASTMATH
from train.render.cpu.mat3 import matmul, matvec, quat_to_rotmat, rotmat_vjp, transpose
from train.render.cpu.sh import sh_basis, sh_basis_grads
from train.render.semantics import ALPHA_MIN, EPS2D, FAR_PLANE, NEAR_PLANE, RADIUS_SIGMAS, num_sh_bases
from train.render.errors import RenderError, first_nonfinite, nonfinite
from train.render.splats2d import GRAD_FLOATS, Splats2D

_FOV_MARGIN = 0.3  # the Jacobian is evaluated at most 30% of a half field of view outside the image
_NORM_EPS = 1e-12  # as torch's F.normalize
_MAX_RADIUS = 2.0 ** 30  # radii are stored as int32; any radius this large covers the whole image


def camera_params(camera: Camera) -> np.ndarray:  # [23] float64
    """R (9, row-major), t (3), fx, fy, cx, cy, the Jacobian's clamp on x/z (neg, pos) and y/z
    (neg, pos), the camera centre (3)."""
    K, vm = camera.K, camera.viewmat
    fx, fy, cx, cy = K[0, 0], K[1, 1], K[0, 2], K[1, 2]
    mx, my = _FOV_MARGIN * 0.5 * camera.width / fx, _FOV_MARGIN * 0.5 * camera.height / fy
    lims = [cx / fx + mx, (camera.width - cx) / fx + mx, cy / fy + my, (camera.height - cy) / fy + my]
    return np.concatenate([vm[:3, :3].ravel(), vm[:3, 3], [fx, fy, cx, cy], lims, camera.center])


@njit(cache=True, nogil=True, fastmath=FINITE_FASTMATH)
def _splat_frame(means, quats, scales, cam, g):
    """Camera-space mean, unit quaternion (and the raw norm), rotation, scales, camera covariance."""
    R = (cam[0], cam[1], cam[2], cam[3], cam[4], cam[5], cam[6], cam[7], cam[8])
    m = (float(means[g, 0]), float(means[g, 1]), float(means[g, 2]))
    p = matvec(R, m)
    pc = (p[0] + cam[9], p[1] + cam[10], p[2] + cam[11])
    qw, qx, qy, qz = float(quats[g, 0]), float(quats[g, 1]), float(quats[g, 2]), float(quats[g, 3])
    qn = max(math.sqrt(qw * qw + qx * qx + qy * qy + qz * qz), _NORM_EPS)
    q = (qw / qn, qx / qn, qy / qn, qz / qn)
    rq = quat_to_rotmat(q[0], q[1], q[2], q[3])
    s = (math.exp(scales[g, 0]), math.exp(scales[g, 1]), math.exp(scales[g, 2]))
    rs = (rq[0] * s[0], rq[1] * s[1], rq[2] * s[2], rq[3] * s[0], rq[4] * s[1], rq[5] * s[2],
          rq[6] * s[0], rq[7] * s[1], rq[8] * s[2])
    rrs = matmul(R, rs)
    cov_c = matmul(rrs, transpose(rrs))
    return R, pc, q, qn, rq, s, rs, cov_c


@njit(cache=True, nogil=True, fastmath=FINITE_FASTMATH)
def _jacobian(pc, cam):
    """Nonzero entries j00, j02, j11, j12 of J = [[fx/z, 0, -fx rx/z], [0, fy/z, -fy ry/z]] with
    rx, ry the clamped x/z, y/z; and whether x/z, y/z were inside the clamp."""
    fx, fy = cam[12], cam[13]
    z = pc[2]
    rx_raw, ry_raw = pc[0] / z, pc[1] / z
    rx = min(max(rx_raw, -cam[16]), cam[17])
    ry = min(max(ry_raw, -cam[18]), cam[19])
    return fx / z, -fx * rx / z, fy / z, -fy * ry / z, rx, ry, rx == rx_raw, ry == ry_raw


@njit(cache=True, nogil=True, fastmath=FINITE_FASTMATH)
def _cov2d(j00, j02, j11, j12, S):  # J S J^T for the sparse J, S a symmetric 9-tuple
    c00 = j00 * j00 * S[0] + 2.0 * j00 * j02 * S[2] + j02 * j02 * S[8]
    c01 = j00 * j11 * S[1] + j00 * j12 * S[2] + j02 * j11 * S[5] + j02 * j12 * S[8]
    c11 = j11 * j11 * S[4] + 2.0 * j11 * j12 * S[5] + j12 * j12 * S[8]
    return c00, c01, c11


@njit(inline="always", fastmath=FINITE_FASTMATH)
def _finite_row(means, quats, scales, logits, sh0, shN, n_rest, g):  # whether row g's values are all finite
    """Their sum in float64, which no float32 values overflow: NaN or inf exactly when one of them is
    (tested by a comparison: under these fast-math flags LLVM folded `math.isfinite` to True)."""
    total = float(logits[g])
    for c in range(3):
        total += float(means[g, c]) + float(scales[g, c]) + float(sh0[g, 0, c])
        for b in range(n_rest):
            total += float(shN[g, b, c])
    for c in range(4):
        total += float(quats[g, c])
    return abs(total) < math.inf


@njit(parallel=True, cache=True, nogil=True, fastmath=FINITE_FASTMATH)
def _project(means, quats, scales, logits, sh0, shN, n_rest, cam, width, height, rows,
             means2d, conics, depths, opacities, radii, keep):  # -> rows with a non-finite value
    """Projects the Gaussians `rows`; output j belongs to rows[j]. Every row is tested for NaN and
    inf first (its parameters and its first `n_rest` SH rest coefficients, those the degree reads),
    as it is read anyway: a row that fails is counted and dropped."""
    bad_rows = 0
    for j in prange(rows.size):
        g = rows[j]
        keep[j] = False
        if not _finite_row(means, quats, scales, logits, sh0, shN, n_rest, g):
            bad_rows += 1
            continue
        R, pc, q, qn, rq, s, rs, cov_c = _splat_frame(means, quats, scales, cam, g)
        z = pc[2]
        if not (NEAR_PLANE <= z <= FAR_PLANE):
            continue
        j00, j02, j11, j12, rx, ry, _, _ = _jacobian(pc, cam)
        c00, c01, c11 = _cov2d(j00, j02, j11, j12, cov_c)
        c00 += EPS2D
        c11 += EPS2D
        det = c00 * c11 - c01 * c01
        o = 1.0 / (1.0 + math.exp(-float(logits[g])))
        if not (0.0 < det < math.inf) or o < ALPHA_MIN:  # also drops splats whose scales overflow
            continue
        extend = min(RADIUS_SIGMAS, math.sqrt(2.0 * math.log(o / ALPHA_MIN)))
        rad_x, rad_y = math.ceil(extend * math.sqrt(c00)), math.ceil(extend * math.sqrt(c11))
        u, v = cam[12] * pc[0] / z + cam[14], cam[13] * pc[1] / z + cam[15]
        if (rad_x <= 0.0 and rad_y <= 0.0) or u + rad_x <= 0.0 or u - rad_x >= width \
                or v + rad_y <= 0.0 or v - rad_y >= height:
            continue
        keep[j] = True
        means2d[j, 0], means2d[j, 1] = u, v
        conics[j, 0], conics[j, 1], conics[j, 2] = c11 / det, -c01 / det, c00 / det
        depths[j], opacities[j] = z, o
        radii[j, 0], radii[j, 1] = min(rad_x, _MAX_RADIUS), min(rad_y, _MAX_RADIUS)
    return bad_rows


@njit(cache=True, nogil=True, fastmath=FINITE_FASTMATH)
def _view_dir(means, cam, g):  # unit direction from the camera centre, and the distance
    d = (means[g, 0] - cam[20], means[g, 1] - cam[21], means[g, 2] - cam[22])
    norm = max(math.sqrt(d[0] * d[0] + d[1] * d[1] + d[2] * d[2]), _NORM_EPS)
    return (d[0] / norm, d[1] / norm, d[2] / norm), norm


@njit(cache=True, nogil=True, fastmath=FINITE_FASTMATH)
def _coeff(sh0, shN, g, b, c):
    return float(sh0[g, 0, c]) if b == 0 else float(shN[g, b - 1, c])


@njit(cache=True, nogil=True, fastmath=FINITE_FASTMATH)
def _sh_raw(sh0, shN, g, basis, n_bases):  # SH colour before + 0.5 and the clamp
    r, gr, bl = 0.0, 0.0, 0.0
    for b in range(n_bases):
        r += basis[b] * _coeff(sh0, shN, g, b, 0)
        gr += basis[b] * _coeff(sh0, shN, g, b, 1)
        bl += basis[b] * _coeff(sh0, shN, g, b, 2)
    return r, gr, bl


@njit(parallel=True, cache=True, nogil=True, fastmath=FINITE_FASTMATH)
def _colors(means, sh0, shN, ids, cam, n_bases, colors):
    for i in prange(ids.size):
        g = ids[i]
        n, _ = _view_dir(means, cam, g)
        raw = _sh_raw(sh0, shN, g, sh_basis(n[0], n[1], n[2]), n_bases)
        for c in range(3):
            colors[i, c] = max(raw[c] + 0.5, 0.0)


@njit(inline="always", fastmath=FINITE_FASTMATH)
def _rest_vjp(shN, g_shN, g, b, basis_b, gx_b, gy_b, gz_b, v_raw, vn):  # -> vn with basis b's terms added
    """SH basis b >= 1 of row g: its coefficients' gradient, and its pull on the view direction
    (the colour gradient dotted with the coefficients, times the basis' gradient)."""
    w = 0.0
    for c in range(3):
        w += float(shN[g, b - 1, c]) * v_raw[c]
        g_shN[g, b - 1, c] += basis_b * v_raw[c]
    return vn[0] + w * gx_b, vn[1] + w * gy_b, vn[2] + w * gz_b


@njit(parallel=True, cache=True, nogil=True, fastmath=FINITE_FASTMATH)
def _project_vjp(means, quats, scales, logits, sh0, shN, cam, ids, n_bases, v,
                 g_means, g_quats, g_scales, g_logits, g_sh0, g_shN):
    """Adds the gradients of the kept rows `ids` (unique) to the full-size g_* arrays. v [M, 9]:
    the gradients of means2d, conics, opacities and colours in `pack_grads` layout."""
    fx, fy = cam[12], cam[13]
    for i in prange(ids.size):
        g = ids[i]
        R, pc, q, qn, rq, s, rs, cov_c = _splat_frame(means, quats, scales, cam, g)
        x, y, z = pc
        j00, j02, j11, j12, rx, ry, free_x, free_y = _jacobian(pc, cam)
        c00, c01, c11 = _cov2d(j00, j02, j11, j12, cov_c)
        c00 += EPS2D
        c11 += EPS2D
        det = c00 * c11 - c01 * c01
        qa, qb, qc = c11 / det, -c01 / det, c00 / det  # the conic Q = C^-1
        # Q = C^-1 => dL/dC = -Q G Q with G the symmetric gradient of Q (off-diagonal split in two).
        ga, gb, gc = float(v[i, 2]), 0.5 * float(v[i, 3]), float(v[i, 4])
        t00, t01, t10, t11 = qa * ga + qb * gb, qa * gb + qb * gc, qb * ga + qc * gb, qb * gb + qc * gc
        vc00 = -(t00 * qa + t01 * qb)
        vc01 = -(t00 * qb + t01 * qc)
        vc11 = -(t10 * qb + t11 * qc)
        # C = J S J^T => dL/dS = J^T V J, dL/dJ = 2 V J S (rows J0 = (j00, 0, j02), J1 = (0, j11, j12)).
        J0, J1 = (j00, 0.0, j02), (0.0, j11, j12)
        v_cov_c = (vc00 * J0[0] * J0[0] + vc01 * (J0[0] * J1[0] + J1[0] * J0[0]) + vc11 * J1[0] * J1[0],
                   vc00 * J0[0] * J0[1] + vc01 * (J0[0] * J1[1] + J1[0] * J0[1]) + vc11 * J1[0] * J1[1],
                   vc00 * J0[0] * J0[2] + vc01 * (J0[0] * J1[2] + J1[0] * J0[2]) + vc11 * J1[0] * J1[2],
                   vc00 * J0[1] * J0[0] + vc01 * (J0[1] * J1[0] + J1[1] * J0[0]) + vc11 * J1[1] * J1[0],
                   vc00 * J0[1] * J0[1] + vc01 * (J0[1] * J1[1] + J1[1] * J0[1]) + vc11 * J1[1] * J1[1],
                   vc00 * J0[1] * J0[2] + vc01 * (J0[1] * J1[2] + J1[1] * J0[2]) + vc11 * J1[1] * J1[2],
                   vc00 * J0[2] * J0[0] + vc01 * (J0[2] * J1[0] + J1[2] * J0[0]) + vc11 * J1[2] * J1[0],
                   vc00 * J0[2] * J0[1] + vc01 * (J0[2] * J1[1] + J1[2] * J0[1]) + vc11 * J1[2] * J1[1],
                   vc00 * J0[2] * J0[2] + vc01 * (J0[2] * J1[2] + J1[2] * J0[2]) + vc11 * J1[2] * J1[2])
        j0s, j1s = matvec(cov_c, J0), matvec(cov_c, J1)  # J_k S (S symmetric)
        v_j00 = 2.0 * (vc00 * j0s[0] + vc01 * j1s[0])
        v_j02 = 2.0 * (vc00 * j0s[2] + vc01 * j1s[2])
        v_j11 = 2.0 * (vc01 * j0s[1] + vc11 * j1s[1])
        v_j12 = 2.0 * (vc01 * j0s[2] + vc11 * j1s[2])
        # J and means2d = (fx x/z + cx, fy y/z + cy) -> camera-space mean.
        vu, vv = float(v[i, 0]), float(v[i, 1])
        zz = z * z
        v_x = vu * fx / z + (v_j02 * -fx / zz if free_x else 0.0)
        v_y = vv * fy / z + (v_j12 * -fy / zz if free_y else 0.0)
        v_z = (-vu * fx * x / zz - vv * fy * y / zz - v_j00 * fx / zz - v_j11 * fy / zz
               + v_j02 * (fx * rx / zz + (fx * x / (zz * z) if free_x else 0.0))
               + v_j12 * (fy * ry / zz + (fy * y / (zz * z) if free_y else 0.0)))
        v_mean = matvec(transpose(R), (v_x, v_y, v_z))
        # S = (R Rq s)(R Rq s)^T => dL/d(Rq s) = 2 R^T dL/dS R (Rq s).
        v_rs = matmul(matmul(transpose(R), matmul(v_cov_c, R)), rs)
        v_rs = (2.0 * v_rs[0], 2.0 * v_rs[1], 2.0 * v_rs[2], 2.0 * v_rs[3], 2.0 * v_rs[4], 2.0 * v_rs[5],
                2.0 * v_rs[6], 2.0 * v_rs[7], 2.0 * v_rs[8])
        v_rq = (v_rs[0] * s[0], v_rs[1] * s[1], v_rs[2] * s[2], v_rs[3] * s[0], v_rs[4] * s[1], v_rs[5] * s[2],
                v_rs[6] * s[0], v_rs[7] * s[1], v_rs[8] * s[2])
        for j in range(3):
            g_scales[g, j] += s[j] * (v_rs[j] * rq[j] + v_rs[3 + j] * rq[3 + j] + v_rs[6 + j] * rq[6 + j])
        v_q = rotmat_vjp(q[0], q[1], q[2], q[3], v_rq)
        dot = q[0] * v_q[0] + q[1] * v_q[1] + q[2] * v_q[2] + q[3] * v_q[3]
        for j in range(4):
            g_quats[g, j] += (v_q[j] - q[j] * dot) / qn
        o = 1.0 / (1.0 + math.exp(-float(logits[g])))
        g_logits[g] += v[i, 5] * o * (1.0 - o)
        # Colour: the direction from the camera moves with the mean.
        n, dist = _view_dir(means, cam, g)
        basis = sh_basis(n[0], n[1], n[2])
        raw = _sh_raw(sh0, shN, g, basis, n_bases)
        # The clamp at 0 passes the gradient where the value is >= 0, as torch's clamp_min does.
        v_raw = (float(v[i, 6]) if raw[0] + 0.5 >= 0.0 else 0.0,
                 float(v[i, 7]) if raw[1] + 0.5 >= 0.0 else 0.0,
                 float(v[i, 8]) if raw[2] + 0.5 >= 0.0 else 0.0)
        gx, gy, gz = sh_basis_grads(n[0], n[1], n[2])
        for c in range(3):
            g_sh0[g, 0, c] += basis[0] * v_raw[c]
        vn = (0.0, 0.0, 0.0)  # basis 0 is constant: no direction gradient
        # One call a basis, each with constant tuple indices: a loop over b indexed the four
        # 16-tuples through memory, which took half of this kernel's time at SH degree 3.
        if n_bases > 1:
            vn = _rest_vjp(shN, g_shN, g, 1, basis[1], gx[1], gy[1], gz[1], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 2, basis[2], gx[2], gy[2], gz[2], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 3, basis[3], gx[3], gy[3], gz[3], v_raw, vn)
        if n_bases > 4:
            vn = _rest_vjp(shN, g_shN, g, 4, basis[4], gx[4], gy[4], gz[4], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 5, basis[5], gx[5], gy[5], gz[5], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 6, basis[6], gx[6], gy[6], gz[6], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 7, basis[7], gx[7], gy[7], gz[7], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 8, basis[8], gx[8], gy[8], gz[8], v_raw, vn)
        if n_bases > 9:
            vn = _rest_vjp(shN, g_shN, g, 9, basis[9], gx[9], gy[9], gz[9], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 10, basis[10], gx[10], gy[10], gz[10], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 11, basis[11], gx[11], gy[11], gz[11], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 12, basis[12], gx[12], gy[12], gz[12], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 13, basis[13], gx[13], gy[13], gz[13], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 14, basis[14], gx[14], gy[14], gz[14], v_raw, vn)
            vn = _rest_vjp(shN, g_shN, g, 15, basis[15], gx[15], gy[15], gz[15], v_raw, vn)
        vn_x, vn_y, vn_z = vn
        ndot = n[0] * vn_x + n[1] * vn_y + n[2] * vn_z
        g_means[g, 0] += v_mean[0] + (vn_x - n[0] * ndot) / dist
        g_means[g, 1] += v_mean[1] + (vn_y - n[1] * ndot) / dist
        g_means[g, 2] += v_mean[2] + (vn_z - n[2] * ndot) / dist


@njit(parallel=True, cache=True, nogil=True, fastmath=FINITE_FASTMATH)
def _compact(keep, rows, means2d, conics, depths, opacities, radii):
    """The kept entries of `_project`'s outputs, in order, and their rows (numpy's boolean
    indexing of the seven arrays ran on one core and cost a third of the projection)."""
    n = keep.size
    at = np.empty(n, np.int64)
    m = 0
    for j in range(n):
        at[j] = m
        m += keep[j]
    out = (np.empty((m, 2), np.float32), np.empty((m, 3), np.float32), np.empty(m, np.float32),
           np.empty(m, np.float32), np.empty((m, 2), np.int32), np.empty(m, np.int64))
    for j in prange(n):
        if keep[j]:
            i = at[j]
            out[0][i, 0], out[0][i, 1] = means2d[j, 0], means2d[j, 1]
            out[1][i, 0], out[1][i, 1], out[1][i, 2] = conics[j, 0], conics[j, 1], conics[j, 2]
            out[2][i], out[3][i] = depths[j], opacities[j]
            out[4][i, 0], out[4][i, 1] = radii[j, 0], radii[j, 1]
            out[5][i] = rows[j]
    return out


def _array(t: Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _gradient_sums(arrays: list[np.ndarray], n_bases: int) -> list[np.ndarray]:
    """Zeroed gradient sums shaped as the parameters. At SH degree 0 nothing writes shN's (and
    Adam, by `grad_columns`, never reads them): they are fresh anonymous pages, which cost nothing
    unless touched; np.zeros would memset them on one core once glibc's mmap threshold lies past
    their size, as it does after freeing the first and from the trainer's start (`train.heap`)
    (~0.3 ms a step at 50k Gaussians). (The trainer's own batches no longer hold those
    coefficients on the CPU, `train.step.sh_coeffs_gathered`; callers of `project` with whole
    splats still do.) Above degree 0 every page of them is written, and fresh pages would fault
    in one at a time under the process's memory lock (garden forward+backward 83 -> 91 ms)."""
    *rest, shN = arrays  # in _PARAM_ORDER: shN last
    sums = [np.zeros(a.shape, a.dtype) for a in rest]
    if n_bases > 1 or shN.nbytes < mmap.PAGESIZE:
        return sums + [np.zeros(shN.shape, shN.dtype)]
    return sums + [np.frombuffer(mmap.mmap(-1, shN.nbytes), shN.dtype).reshape(shN.shape)]


_PARAM_ORDER = ("means", "quats", "scales", "opacities", "sh0", "shN")  # the kernels' argument order


def _project_rows(arrays: list[np.ndarray], cam: np.ndarray, width: int, height: int, rows: np.ndarray,
                  n_bases: int) -> tuple[np.ndarray, ...]:
    """means2d [M, 2], conics [M, 3], opacities [M], colors [M, 3], depths [M], radii [M, 2] and
    ids [M] (int64, a subset of `rows`) of the rows that land in the image."""
    n = len(rows)
    means2d, conics = np.empty((n, 2), np.float32), np.empty((n, 3), np.float32)
    depths, opacities = np.empty(n, np.float32), np.empty(n, np.float32)
    radii, keep = np.empty((n, 2), np.int32), np.empty(n, np.bool_)
    if _project(arrays[0], arrays[1], arrays[2], arrays[3], arrays[4], arrays[5], n_bases - 1, cam, width, height,
                rows, means2d, conics, depths, opacities, radii, keep):
        raise _nonfinite_field(arrays, rows, n_bases)
    means2d, conics, depths, opacities, radii, ids = _compact(keep, rows, means2d, conics, depths, opacities, radii)
    colors = np.empty((len(ids), 3), np.float32)
    _colors(arrays[0], arrays[4], arrays[5], ids, cam, n_bases, colors)
    return means2d, conics, opacities, colors, depths, radii, ids


def _nonfinite_field(arrays: list[np.ndarray], rows: np.ndarray, n_bases: int) -> RenderError:
    """The error naming the first parameter (in `_PARAM_ORDER`) with a NaN or inf among `rows`."""
    bad = first_nonfinite((name, a[rows] if name != "shN" else a[rows, :n_bases - 1])
                          for name, a in zip(_PARAM_ORDER, arrays))
    return bad if bad is not None else nonfinite("splats")  # (a float64 sum of float32 values cannot overflow)


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, means: Tensor, quats: Tensor, scales: Tensor, logits: Tensor, sh0: Tensor, shN: Tensor,
                cam: np.ndarray, width: int, height: int, n_bases: int):
        arrays = [_array(t) for t in (means, quats, scales, logits, sh0, shN)]
        *outs, ids = _project_rows(arrays, cam, width, height, np.arange(len(means)), n_bases)
        ctx.state = (arrays, cam, ids, n_bases)
        outs = [torch.from_numpy(a) for a in (*outs, ids)]
        ctx.mark_non_differentiable(*outs[4:])
        return tuple(outs)

    @staticmethod
    def backward(ctx, v_means2d, v_conics, v_opacities, v_colors, _v_depths, _v_radii, _v_ids):
        arrays, cam, ids, n_bases = ctx.state
        grads = _gradient_sums(arrays, n_bases)
        v = torch.cat([v_means2d, v_conics, v_opacities[:, None], v_colors], dim=1)
        _project_vjp(*arrays, cam, ids, n_bases, _array(v), *grads)
        return (*(torch.from_numpy(g) for g in grads), None, None, None, None)


def project_cpu(splats: dict[str, Tensor], camera: Camera, sh_degree: int) -> Splats2D:
    """The splats (CPU float32 tensors) that land in the image; differentiable w.r.t. every parameter."""
    means2d, conics, opacities, colors, depths, radii, ids = _Project.apply(
        *(splats[name] for name in _PARAM_ORDER), camera_params(camera), camera.width, camera.height,
        num_sh_bases(sh_degree))
    if means2d.requires_grad:
        means2d.retain_grad()  # densification reads the screen-space gradient per splat
    return Splats2D(means2d, conics, depths, opacities, colors, radii, ids)


class CpuProjectedBatch:
    """One batch of Gaussians projected into several cameras, with one backward for all of them.

    An owner projects its Gaussians into every camera of a step that sees them. Through autograd
    each camera cost an indexing of the batch, a full-size zero gradient and its accumulation, on
    top of the kernels (~2 ms a camera at a few thousand Gaussians); here a camera costs its
    kernels alone. Gradients are summed into one set of arrays in camera order, so a Gaussian's
    sum does not depend on which other Gaussians were batched with it."""

    def __init__(self, splats: dict[str, Tensor], views: list[tuple[int, Camera, np.ndarray | None]],
                 sh_degree: int) -> None:
        self._params = [splats[name] for name in _PARAM_ORDER]
        self._arrays = [_array(t) for t in self._params]
        self._n_bases = num_sh_bases(sh_degree)
        self._state: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # camera -> (camera params, ids)
        self.splats: dict[int, Splats2D] = {}
        n = len(self._arrays[0])
        for i, camera, rows in views:
            cam = camera_params(camera)
            rows = np.arange(n) if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
            means2d, conics, opacities, colors, depths, radii, ids = (
                torch.from_numpy(a) for a in _project_rows(self._arrays, cam, camera.width, camera.height, rows,
                                                           self._n_bases))
            self._state[i] = cam, ids.numpy()
            self.splats[i] = Splats2D(means2d, conics, depths, opacities, colors, radii, ids)

    def backward(self, grads: dict[int, Tensor]) -> None:  # camera -> [M, 9] in pack_grads layout
        """Adds the parameters' gradients to their `.grad`."""
        sums = _gradient_sums(self._arrays, self._n_bases)
        for i in sorted(grads):
            cam, ids = self._state[i]
            v = _array(grads[i].to(torch.float32))
            if v.shape != (len(ids), GRAD_FLOATS):
                raise RenderError(f"camera {i}: gradients of shape {v.shape}, expected ({len(ids)}, {GRAD_FLOATS})")
            _project_vjp(*self._arrays, cam, ids, self._n_bases, v, *sums)
        for p, g in zip(self._params, sums):
            if p.requires_grad:
                p.grad = torch.from_numpy(g) if p.grad is None else p.grad + torch.from_numpy(g)
