/* Encode a run of equal-sized Opus frames in one call, the GIL released once around the whole run.
 *
 * Why C: every ctypes call into libopus drops and retakes the GIL. With hundreds of streams, each engine chunk is
 * 8 frames (160 ms at 20 ms), and the encode threads then contend with the event loop for the GIL 8 times per chunk;
 * under load each retake waits for the loop to yield (up to the 5 ms switch interval). One release per chunk keeps
 * encoding off the GIL. libopus is not linked here: the caller passes the address of opus_encode_float from the
 * library ctypes (opuslib) already loaded, so this builds with nothing but a C compiler and the Python headers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef int (*encode_float_fn)(void *state, const float *pcm, int frame_size, unsigned char *data, int max_bytes);

enum { MAX_PACKET = 1500 }; /* an Opus packet is at most 1275 bytes per frame (RFC 6716 3.4) */

static PyObject *encode(PyObject *self, PyObject *args) {
    unsigned long long fn_addr, state_addr;
    Py_buffer pcm;
    int frame_size;
    if (!PyArg_ParseTuple(args, "KKy*i", &fn_addr, &state_addr, &pcm, &frame_size))
        return NULL;
    if (frame_size <= 0 || pcm.len % ((Py_ssize_t)sizeof(float) * frame_size) != 0) {
        PyBuffer_Release(&pcm);
        return PyErr_Format(PyExc_ValueError, "pcm must hold whole frames of %d float32 samples", frame_size);
    }
    Py_ssize_t frames = pcm.len / (Py_ssize_t)sizeof(float) / frame_size;
    unsigned char *out = PyMem_RawMalloc((size_t)(frames ? frames : 1) * MAX_PACKET);
    int *sizes = PyMem_RawMalloc((size_t)(frames ? frames : 1) * sizeof(int));
    if (out == NULL || sizes == NULL) {
        PyMem_RawFree(out);
        PyMem_RawFree(sizes);
        PyBuffer_Release(&pcm);
        return PyErr_NoMemory();
    }
    encode_float_fn encode_float = (encode_float_fn)(uintptr_t)fn_addr;
    const float *samples = (const float *)pcm.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < frames; i++)
        sizes[i] = encode_float((void *)(uintptr_t)state_addr, samples + i * frame_size, frame_size,
                                out + i * MAX_PACKET, MAX_PACKET);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&pcm);
    PyObject *packets = PyList_New(frames);
    for (Py_ssize_t i = 0; packets != NULL && i < frames; i++) {
        if (sizes[i] < 0) { /* an opus error code, as opuslib would raise it */
            PyErr_Format(PyExc_RuntimeError, "opus_encode_float failed with error %d", sizes[i]);
            Py_CLEAR(packets);
            break;
        }
        PyObject *packet = PyBytes_FromStringAndSize((const char *)out + i * MAX_PACKET, sizes[i]);
        if (packet == NULL) {
            Py_CLEAR(packets);
            break;
        }
        PyList_SET_ITEM(packets, i, packet);
    }
    PyMem_RawFree(out);
    PyMem_RawFree(sizes);
    return packets;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(opus_encode_float_address, encoder_state_address, pcm_float32, frame_size) -> list[bytes]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_opus_frames", NULL, -1, methods};

PyMODINIT_FUNC PyInit__opus_frames(void) { return PyModule_Create(&module); }
