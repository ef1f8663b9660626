/* write_rows_frame: one trace frame of pre-encoded rows, joined, checksummed (CRC-32) and written
 * with the interpreter lock released, so the writer thread barely competes with vLLM's scheduler
 * thread. kvtrace/traceio/writer.py has its twin, TraceWriter.
 */
#include "kvtrace_native.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint32_t crc_table[256];

/* Fill the CRC-32 table, once, when the module loads. */
void
frames_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        }
        crc_table[n] = c;
    }
}

/* CRC-32 as zlib.crc32 computes it (reflected, polynomial 0xEDB88320). */
static uint32_t
crc32_of(const unsigned char *data, size_t size)
{
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < size; i++) {
        c = crc_table[(c ^ data[i]) & 0xFF] ^ (c >> 8);
    }
    return c ^ 0xFFFFFFFFu;
}

static void
put_u32_le(unsigned char *out, uint32_t value)
{
    out[0] = value & 0xFF;
    out[1] = (value >> 8) & 0xFF;
    out[2] = (value >> 16) & 0xFF;
    out[3] = (value >> 24) & 0xFF;
}

/* Length of the msgpack array header `chunk` starts with, and the number of items it announces;
 * -1 if it is not an array header. */
static Py_ssize_t
array_header(const unsigned char *chunk, Py_ssize_t size, Py_ssize_t *num_items)
{
    if (size >= 1 && (chunk[0] & 0xF0) == 0x90) {
        *num_items = chunk[0] & 0x0F;
        return 1;
    }
    if (size >= 3 && chunk[0] == 0xDC) {
        *num_items = ((Py_ssize_t)chunk[1] << 8) | chunk[2];
        return 3;
    }
    if (size >= 5 && chunk[0] == 0xDD) {
        *num_items = ((Py_ssize_t)chunk[1] << 24) | ((Py_ssize_t)chunk[2] << 16)
                     | ((Py_ssize_t)chunk[3] << 8) | chunk[4];
        return 5;
    }
    return -1;
}

/* write_rows_frame(fd, chunks) -> number of records: one R frame of pre-encoded rows, as
 * TraceWriter writes it. Each chunk is (number of records, encode_rows(records)); the frame's
 * payload is b"R", one msgpack array32 header for all the records, and each chunk without its
 * own array header; the frame is u32 payload length, u32 crc32(payload), payload. Joining,
 * checksumming and writing happen with the interpreter lock released. */
PyObject *
write_rows_frame(PyObject *module, PyObject *args)
{
    int fd;
    PyObject *chunks;
    if (!PyArg_ParseTuple(args, "iO!:write_rows_frame", &fd, &PyList_Type, &chunks)) {
        return NULL;
    }
    Py_ssize_t num_chunks = PyList_GET_SIZE(chunks);
    PyObject **held = PyMem_Malloc(sizeof(PyObject *) * (num_chunks + 1));
    Py_ssize_t *skip = PyMem_Malloc(sizeof(Py_ssize_t) * (num_chunks + 1));
    if (held == NULL || skip == NULL) {
        PyMem_Free(held);
        PyMem_Free(skip);
        return PyErr_NoMemory();
    }
    Py_ssize_t num_held = 0, num_records = 0;
    size_t payload_size = 1 + 5;
    for (; num_held < num_chunks; num_held++) {
        PyObject *chunk = PyList_GET_ITEM(chunks, num_held), *body;
        Py_ssize_t size, announced;
        if (!PyTuple_CheckExact(chunk) || PyTuple_GET_SIZE(chunk) != 2
            || !PyBytes_Check(body = PyTuple_GET_ITEM(chunk, 1))
            || (size = PyLong_AsSsize_t(PyTuple_GET_ITEM(chunk, 0))) < 0
            || (skip[num_held] = array_header((const unsigned char *)PyBytes_AS_STRING(body),
                                              PyBytes_GET_SIZE(body), &announced)) < 0
            || announced != size) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "write_rows_frame: each chunk must be "
                                "(number of records, encode_rows(records))");
            }
            break;
        }
        held[num_held] = Py_NewRef(body); /* bytes are immutable: readable without the lock */
        payload_size += PyBytes_GET_SIZE(body) - skip[num_held];
        num_records += size;
    }
    int error = 0;
    if (num_held == num_chunks && (payload_size > 0xFFFFFFFFu || num_records > 0xFFFFFFFFL)) {
        PyErr_SetString(PyExc_OverflowError, "write_rows_frame: frame larger than 4 GiB");
    }
    if (!PyErr_Occurred()) {
        Py_BEGIN_ALLOW_THREADS
        unsigned char *frame = malloc(8 + payload_size);
        if (frame == NULL) {
            error = ENOMEM;
        } else {
            unsigned char *out = frame + 8;
            *out++ = 'R';
            *out++ = 0xDD;
            for (int shift = 24; shift >= 0; shift -= 8) {
                *out++ = (num_records >> shift) & 0xFF;
            }
            for (Py_ssize_t i = 0; i < num_held; i++) {
                Py_ssize_t body_size = PyBytes_GET_SIZE(held[i]) - skip[i];
                memcpy(out, PyBytes_AS_STRING(held[i]) + skip[i], body_size);
                out += body_size;
            }
            put_u32_le(frame, (uint32_t)payload_size);
            put_u32_le(frame + 4, crc32_of(frame + 8, payload_size));
            size_t written = 0;
            while (written < 8 + payload_size) {
                ssize_t n = write(fd, frame + written, 8 + payload_size - written);
                if (n < 0) {
                    if (errno == EINTR) {
                        continue;
                    }
                    error = errno;
                    break;
                }
                written += (size_t)n;
            }
            free(frame);
        }
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t i = 0; i < num_held; i++) {
        Py_DECREF(held[i]);
    }
    PyMem_Free(held);
    PyMem_Free(skip);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (error) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(num_records);
}
