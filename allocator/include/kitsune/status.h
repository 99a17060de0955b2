/* kitsune/status.h — the one error convention of Kitsune's C libraries. */
#ifndef KITSUNE_STATUS_H
#define KITSUNE_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kt_status {
  KT_OK = 0,
  KT_ERR_INVALID = 1,   /* bad argument: unknown pointer, double free, bad value */
  KT_ERR_OOM = 2,       /* device memory exhausted or memory limit reached */
  KT_ERR_BACKEND = 3,   /* the backend failed for another reason (driver error) */
  KT_ERR_HOST_OOM = 4,  /* host metadata allocation failed */
  KT_ERR_LIMIT = 5,     /* a fixed capacity of the pool was exceeded (streams) */
  KT_ERR_IO = 6,        /* a file could not be opened or written */
  KT_ERR_UNAVAILABLE = 7, /* no device / driver, or feature not built */
} kt_status;

/* Static string naming the status ("out of memory", ...). */
const char *kt_status_str(kt_status s);

#ifdef __cplusplus
}
#endif
#endif
