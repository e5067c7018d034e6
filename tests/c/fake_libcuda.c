/*
 * A stand-in for libcuda.so.1 with the two entry points ugdr calls, for tests on hosts without
 * a GPU: cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE) reports device memory for
 * the address in $FAKE_CUDA_DEVICE_PTR (hex) and host memory otherwise. It never dereferences
 * the pointer, like the real driver.
 */
#include <stdint.h>
#include <stdlib.h>

int cuInit(unsigned int flags)
{
	return flags == 0 ? 0 : 1; /* CUDA_SUCCESS / CUDA_ERROR_INVALID_VALUE */
}

int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr)
{
	const char *dev = getenv("FAKE_CUDA_DEVICE_PTR");
	if (attribute != 2) /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE */
		return 1;
	*(unsigned int *)data = dev && strtoull(dev, NULL, 16) == ptr ? 2u : 1u; /* DEVICE : HOST */
	return 0;
}
